"""Kernels as data: a small statement IR (`ir.py`), one printer to Triton source (`printer.py`), and
the schedules rendered on it (`chunked.py`: the chunk-parallel schedule)."""
