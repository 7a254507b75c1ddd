"""Entry points: the ``autopar`` command line (``cli``), the one-call API ``auto_parallelize``
(``api``), launching emitted programs with torchrun and comparing their runs with the plan
(``launch``), the first-run machine calibration (``calibration``), the demo (``demo``) and the
single-process baseline it compares with (``single_process``). The top layer: it may use everything.
"""
