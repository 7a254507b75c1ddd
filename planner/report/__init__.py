"""Reports: a Plan explained as self-contained HTML, Markdown, a Perfetto trace or text
(``render``), from the figures ``data`` derives (memory and time per stage, the schedule, what
each parallelism moves, predicted against a measured run) and the charts ``svg`` draws.
It is user-facing: it may read every layer below it.
"""
