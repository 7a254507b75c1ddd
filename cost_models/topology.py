"""Clusters with structure: groups of nodes (datacenters, regions) and the links between them.

A leaf contract (imports only :mod:`cost_models.hardware`). A cluster file may declare::

    [[groups]]                  # in rank order: group 0 holds nodes 0 .. nodes_0 - 1, and so on
    name = "us-east"
    nodes = 8
    [groups.device]             # optional: this group's device (the cluster's [device] otherwise)
    name = "A100-SXM4-80GB"
    ...

    [[links]]                   # one per pair of groups; asymmetric: declare both directions
    from = "us-east"
    to = "us-west"
    bandwidth_gbs = 12.5        # aggregate one-direction bandwidth between the two groups, GB/s
    latency_us = 10000          # one-way latency (half the round trip), microseconds

Units and assumptions:

- A group link's ``bandwidth_gbs`` is what ALL traffic from one group to the other shares
  (a WAN / DCI circuit), not a per-device figure: ``n`` flows crossing at once get
  ``bandwidth_gbs / n`` each, and never more than a device's own NIC (``[inter]``).
- A link declared in one direction only serves both (symmetric); declaring both makes it
  asymmetric. Every pair of groups needs a link.
- The groups' node counts add up to the cluster's ``nodes``; ranks fill groups in order.
- Nodes of one group talk over ``[inter]`` as in a one-group cluster.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from cost_models.hardware import ClusterError, Device, Link, check_keys, check_table, integer, number, string


@dataclass
class Region:
    """One group of nodes (a datacenter or region): ``nodes`` machines of ``device`` (None: the cluster's)."""

    name: str
    nodes: int
    device: Device | None = None


@dataclass(kw_only=True)
class GroupLink(Link):
    """The link from group ``src`` to group ``dst``: a :class:`~cost_models.hardware.Link` whose
    ``bandwidth_gbs`` is the aggregate one-direction figure every flow between the two groups
    shares (module docstring) and ``latency_us`` the one-way latency."""

    src: str
    dst: str


@dataclass
class Topology:
    """Groups in rank order and the links between them (``declared`` as written, ``pairs`` complete)."""

    groups: list[Region]
    declared: list[GroupLink]
    pairs: dict[tuple[str, str], GroupLink] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.pairs:
            self.pairs = _complete(self.declared)
        starts = [0]
        for g in self.groups:
            starts.append(starts[-1] + g.nodes)
        self._starts = tuple(starts)  # first node of each group (the groups are fixed once made)

    # ---- reading -------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """Nodes of all groups."""
        return sum(g.nodes for g in self.groups)

    def names(self) -> list[str]:
        """Group names in rank order."""
        return [g.name for g in self.groups]

    def group_of_node(self, node: int) -> int:
        """Index of the group holding ``node`` (nodes fill groups in order)."""
        start = 0
        for i, g in enumerate(self.groups):
            start += g.nodes
            if node < start:
                return i
        raise ClusterError(f"node {node} is outside the cluster's {start} nodes: lower the degrees or add nodes")

    def first_node(self, group: int) -> int:
        """The first node of group ``group``."""
        return self._starts[group]

    def link(self, a: int, b: int) -> GroupLink:
        """The link from group index ``a`` to group index ``b`` (a != b)."""
        return self.pairs[(self.groups[a].name, self.groups[b].name)]

    def device(self, group: int, default: Device) -> Device:
        """Group ``group``'s device (``default``: the cluster's)."""
        return self.groups[group].device or default

    def to_dict(self) -> dict[str, Any]:
        """The TOML layout: ``groups`` and ``links`` arrays of tables."""
        groups = [{"name": g.name, "nodes": g.nodes, **({"device": g.device.to_dict()} if g.device else {})}
                  for g in self.groups]
        links = [{"from": k.src, "to": k.dst, **k.to_dict()} for k in self.declared]
        return {"groups": groups, "links": links}

    # ---- building -----------------------------------------------------------
    @classmethod
    def from_dict(cls, groups: Any, links: Any, nodes: int, source: str) -> "Topology":
        """Read ``[[groups]]`` and ``[[links]]`` (module docstring) and check them against ``nodes``."""
        if not isinstance(groups, list) or not groups:
            raise ClusterError(f"{source}: groups must be a non-empty array of tables ([[groups]]), got {groups!r}")
        regions = [_region(g, source, i) for i, g in enumerate(groups)]
        names = [r.name for r in regions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ClusterError(f"{source}: group {dup[0]!r} is declared twice: give each [[groups]] its own name")
        if links is None:
            links = []
        if not isinstance(links, list):
            raise ClusterError(f"{source}: links must be an array of tables ([[links]]), got {type(links).__name__}")
        topo = cls(regions, [_group_link(k, source, i, names) for i, k in enumerate(links)])
        topo.validate(nodes, source)
        return topo

    def validate(self, nodes: int, source: str) -> None:
        """Group names unique, node counts adding up to ``nodes``, a link for every pair of groups."""
        names = self.names()
        for i, g in enumerate(self.groups):
            string(g.name, source, f"groups[{i}].name")
            integer(g.nodes, source, f"groups[{i}].nodes")
            if g.device is not None:
                g.device.validate(source, f"groups[{i}].device")
        if self.nodes != nodes:
            raise ClusterError(f"{source}: the groups hold {self.nodes} nodes but nodes = {nodes}: "
                               f"make nodes the sum of the groups' nodes")
        seen = set()
        for k in self.declared:
            for end in (k.src, k.dst):
                if end not in names:
                    raise ClusterError(f"{source}: link {k.src!r} -> {k.dst!r} names unknown group {end!r}: "
                                       f"use one of {', '.join(names)}")
            if (k.src, k.dst) in seen:
                raise ClusterError(f"{source}: link {k.src!r} -> {k.dst!r} is declared twice: keep one")
            seen.add((k.src, k.dst))
        self.pairs = _complete(self.declared)
        for a in names:
            for b in names:
                if a != b and (a, b) not in self.pairs:
                    raise ClusterError(f"{source}: missing link between groups {a!r} and {b!r}: add [[links]] "
                                       f'from = "{a}" to = "{b}" with bandwidth_gbs and latency_us')


def _complete(declared: Sequence[GroupLink]) -> dict[tuple[str, str], GroupLink]:
    """Every declared direction, plus the reverse of one declared one way only (symmetric)."""
    pairs = {(k.src, k.dst): k for k in declared}
    for k in declared:
        pairs.setdefault((k.dst, k.src), GroupLink(src=k.dst, dst=k.src, bandwidth_gbs=k.bandwidth_gbs,
                                                     latency_us=k.latency_us))
    return pairs


def _region(g: Any, source: str, i: int) -> Region:
    key = f"groups[{i}]"
    check_table(g, source, key)
    check_keys(g, source, f"{key}.", required=("name", "nodes"), optional=("device",))
    dev = Device.from_dict(g["device"], source, f"{key}.device") if "device" in g else None
    return Region(name=string(g["name"], source, f"{key}.name"), nodes=integer(g["nodes"], source, f"{key}.nodes"),
                  device=dev)


def _group_link(k: Any, source: str, i: int, names: list[str]) -> GroupLink:
    key = f"links[{i}]"
    check_table(k, source, key)
    check_keys(k, source, f"{key}.", required=("from", "to", "bandwidth_gbs", "latency_us"))
    src, dst = string(k["from"], source, f"{key}.from"), string(k["to"], source, f"{key}.to")
    for end in (src, dst):
        if end not in names:
            raise ClusterError(f"{source}: {key} names unknown group {end!r}: use one of {', '.join(names)}")
    if src == dst:
        raise ClusterError(f"{source}: {key} joins group {src!r} to itself: nodes inside a group use [inter]; "
                           f"link two different groups")
    return GroupLink(src=src, dst=dst, bandwidth_gbs=number(k["bandwidth_gbs"], source, f"{key}.bandwidth_gbs"),
                     latency_us=number(k["latency_us"], source, f"{key}.latency_us", allow_zero=True))

