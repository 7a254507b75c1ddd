"""Real training data: a flat file of token ids, or a saved, tokenized ``datasets`` dataset,
cut into the global batch of each step from the seed and the step alone.

Sources (the program's and ``autopar run``'s ``--data``; :func:`is_hook` tells them from a
``package.module:function`` hook):

- ``PATH``: token ids back to back with no header (nanoGPT's ``train.bin``, Megatron's
  ``.bin``), memory-mapped with numpy. Its dtype is ``--data-dtype``, else
  :func:`default_dtype`'s rule: the smallest unsigned type holding the model's vocabulary
  (uint16 up to 65,536 ids, as nanoGPT writes; else uint32). Documents end at every
  ``--data-eos`` token (the separator stays the last token of its document), when given.
- ``hf:PATH``: a dataset written by ``save_to_disk``, already tokenized (an ``input_ids``
  column of integer lists); its rows are the documents, concatenated in order. Needs the
  ``datasets`` package (not a dependency of autopar: ``pip install datasets``).

Sampling (:func:`token_batches`): step ``s``'s global batch is ``global_batch`` windows of
``seq_len + 1`` consecutive tokens at offsets drawn uniformly, with replacement (as nanoGPT
samples), by a generator seeded from (seed, step) only: not the layout, not the rank, so every
rank builds the same global batch (``ParallelModel.step`` cuts its share) and a run resumed
under another plan trains on the same batches. A row's ``input_ids`` are the first
``seq_len`` tokens, its ``labels`` the next ones (``input_ids`` when the model shifts them).
Packed documents: when the plan was made for them and the source marks them, the batch
carries ``cu_seqlens`` (codegen/runtime/documents.py) with a boundary at every document start
inside a row and at every row start; otherwise rows are plain windows across documents.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from codegen.runtime.data import FUNC_SPEC

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
HF_PREFIX = "hf:"
SCAN_CHUNK = 1 << 24  # tokens read at a time when scanning a source for out-of-range ids


def is_hook(spec: str) -> bool:
    """Whether ``--data spec`` names a ``package.module:function`` hook (not ``hf:...``, and
    no file of that name exists) rather than a token file or a saved dataset."""
    return not spec.startswith(HF_PREFIX) and bool(FUNC_SPEC.match(spec)) and not os.path.exists(spec)


def default_dtype(vocab: int) -> str:
    """A headerless token file's dtype when ``--data-dtype`` is not given: uint16 when every id
    of a ``vocab``-token vocabulary fits (vocab <= 65,536; 0: unknown), else uint32."""
    return "uint16" if vocab <= 1 << 16 else "uint32"


class TokenSource:
    """Token ids back to back in ``chunks`` (a memory map, or a dataset's arrow buffers), with
    the offsets where documents start (``starts``, sorted; None: unmarked) and the separator
    id that ends a document (``eos``; None: none). ``name`` is what the user gave."""

    def __init__(self, name: str, chunks: list[np.ndarray], starts: np.ndarray | None = None,
                 eos: int | None = None):
        self.name, self.chunks, self.starts, self.eos = name, chunks, starts, eos
        self.offsets = np.cumsum([0] + [len(c) for c in chunks])  # where each chunk starts

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def marks_documents(self) -> bool:
        return self.starts is not None or self.eos is not None

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens ``start .. start + n`` (int64), across chunk ends."""
        out, pos = [], start
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while pos < start + n:
            lo = pos - int(self.offsets[k])
            piece = self.chunks[k][lo:lo + start + n - pos]
            out.append(np.asarray(piece, dtype=np.int64))
            pos, k = pos + len(piece), k + 1
        return np.concatenate(out)

    def document_starts(self, start: int, window: np.ndarray, n: int) -> np.ndarray:
        """Positions ``1 .. n - 1`` of a row of ``n`` tokens (the first ``n`` of ``window``, read
        at ``start``) where a document starts: after a separator, or at a dataset row's start."""
        found = []
        if self.eos is not None:
            found.append(np.flatnonzero(window[:n - 1] == self.eos) + 1)
        if self.starts is not None:
            lo, hi = np.searchsorted(self.starts, [start + 1, start + n])
            found.append(self.starts[lo:hi] - start)
        return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


def open_tokens(spec: str, vocab: int, seq_len: int, dtype: str | None = None,
                eos: int | None = None) -> TokenSource:
    """The source ``--data spec`` names (module docstring), checked to hold at least one window
    of ``seq_len + 1`` tokens; raises ValueError (one line naming the fix) otherwise.
    ``vocab``: the model's vocabulary (0: unknown), for the dtype rule and ``eos``."""
    if eos is not None and (eos < 0 or 0 < vocab <= eos):
        raise ValueError(f"--data-eos {eos} is not a token id of the model's vocabulary (0 .. {vocab - 1}): give the "
                         "id your tokenizer ends documents with")
    if spec.startswith(HF_PREFIX):
        if dtype is not None:
            raise ValueError(f"--data-dtype is for token files; {spec} keeps its ids' own type: drop --data-dtype")
        src = _open_dataset(spec[len(HF_PREFIX):], eos)
    else:
        src = _open_file(spec, dtype or default_dtype(vocab), eos)
    if src.tokens < seq_len + 1:
        raise ValueError(f"--data {spec}: {src.tokens:,} tokens, fewer than one training row needs ({seq_len} + 1): "
                         "give more data or plan a shorter --seq-len")
    return src


def _open_file(path: str, dtype: str, eos: int | None) -> TokenSource:
    if dtype not in DTYPES:
        raise ValueError(f"--data-dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file (a flat file of token ids, a saved dataset as hf:PATH, "
                         "or package.module:function)")
    size, item = os.path.getsize(path), np.dtype(DTYPES[dtype]).itemsize
    if size % item:
        raise ValueError(f"--data {path}: {size:,} bytes is not a whole number of {dtype} ids ({item} bytes each): "
                         f"pass --data-dtype {'uint16' if dtype == 'uint32' else 'uint32'} if the file holds those")
    if size == 0:
        return TokenSource(path, [np.zeros(0, dtype=DTYPES[dtype])], eos=eos)
    return TokenSource(path, [np.memmap(path, dtype=DTYPES[dtype], mode="r")], eos=eos)


def _open_dataset(path: str, eos: int | None) -> TokenSource:
    try:
        import datasets
        import pyarrow as pa
    except ImportError:
        raise ValueError(f"--data hf:{path} needs the `datasets` package, which is not installed: "
                         "pip install datasets (or 'autopar[data]')") from None
    if not os.path.isdir(path):
        raise ValueError(f"--data hf:{path}: no such directory (a tokenized dataset written by save_to_disk)")
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"--data hf:{path} holds the splits {', '.join(ds)}: name one, e.g. "
                         f"hf:{os.path.join(path, next(iter(ds)))}")
    if "input_ids" not in ds.column_names:
        raise ValueError(f"--data hf:{path} has no input_ids column (columns: {', '.join(ds.column_names)}): "
                         "tokenize it first, e.g. dataset.map(lambda r: tokenizer(r['text'])), then save_to_disk")
    chunks, lengths = [], []
    for part in ds.data.column("input_ids").chunks:
        if not (pa.types.is_list(part.type) or pa.types.is_large_list(part.type)) \
                or not pa.types.is_integer(part.type.value_type) or part.null_count:
            raise ValueError(f"--data hf:{path}: input_ids must be lists of integer token ids in every row, "
                             f"got {part.type}{' with empty rows' if part.null_count else ''}")
        chunks.append(part.flatten().to_numpy(zero_copy_only=False))
        lengths.append(part.value_lengths().to_numpy(zero_copy_only=False))
    ends = np.cumsum(np.concatenate(lengths)) if lengths else np.zeros(0, dtype=np.int64)
    return TokenSource(f"hf:{path}", chunks, starts=np.unique(ends[:-1]).astype(np.int64), eos=eos)


def check_ids(src: TokenSource, vocab: int) -> None:
    """Raise ValueError (one line) if any id of ``src`` is negative or not below ``vocab`` (the
    model's vocabulary; 0: unknown, nothing to check): another tokenizer's ids, or a file read
    with the wrong dtype. Reads the whole source, ``SCAN_CHUNK`` tokens at a time."""
    if vocab <= 0:
        return
    for k, chunk in enumerate(src.chunks):
        for lo in range(0, len(chunk), SCAN_CHUNK):
            part = np.asarray(chunk[lo:lo + SCAN_CHUNK])
            bad = (part >= vocab) | (part < 0) if part.dtype.kind == "i" else part >= vocab
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(out_of_range(src, int(part[i]), int(src.offsets[k]) + lo + i, vocab))


def out_of_range(src: TokenSource, value: int, at: int, vocab: int) -> str:
    """The one line refusing token ``value`` at offset ``at`` of ``src``."""
    if src.name.startswith(HF_PREFIX):
        why = "it was tokenized for another model"
    else:
        read = str(src.chunks[0].dtype)
        why = (f"it was tokenized for another model, or it holds {'uint32' if read == 'uint16' else 'uint16'} ids, "
               f"not {read} (pass --data-dtype)")
    return f"--data {src.name}: token {at:,} is {value}, not an id of the model's vocabulary (0 .. {vocab - 1}): {why}"


def token_batches(src: TokenSource, global_batch: int, seq_len: int, seed: int = 0, *, documents: bool = False,
                  model_shifts_labels: bool = False, vocab: int = 0) -> Callable[[int], dict]:
    """``step -> batch`` of windows of ``src`` (module docstring), with ``cu_seqlens`` when
    ``documents`` (the plan packs documents) and ``src`` marks them. Every batch's ids are
    checked against ``vocab`` (0: unchecked)."""
    rows_n = src.tokens - seq_len  # window offsets 0 .. rows_n - 1

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        offsets = torch.randint(0, rows_n, (global_batch,), generator=g).tolist()
        windows = [src.read(o, seq_len + 1) for o in offsets]
        ids = torch.from_numpy(np.stack(windows))
        if vocab > 0 and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            bad = ids.max() if int(ids.max()) >= vocab else ids.min()
            row = int((ids == bad).any(dim=1).int().argmax())
            at = offsets[row] + int((ids[row] == bad).int().argmax())
            raise ValueError(out_of_range(src, int(bad), at, vocab))
        out = {"input_ids": ids[:, :-1].contiguous(),
               "labels": ids[:, :-1].clone() if model_shifts_labels else ids[:, 1:].contiguous()}
        if documents and src.marks_documents:
            cu = [r * seq_len + p for r, (o, w) in enumerate(zip(offsets, windows))
                  for p in [0, *src.document_starts(o, w, seq_len).tolist()]]
            out["cu_seqlens"] = torch.tensor(cu + [global_batch * seq_len], dtype=torch.int64)
        return out

    return batch
