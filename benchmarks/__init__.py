"""Benchmarks: each runs one measurement of autopar (capture and plan speed, predicted against
measured time and memory on this machine's CPU ranks, the published GPU runs, packed documents,
the kernels on a GPU, the first run), prints a table and writes JSON under ``benchmarks/results/``
(``results.write_json``). They may use every layer of the project; nothing imports them.
"""
