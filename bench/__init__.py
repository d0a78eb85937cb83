"""Benchmarks: ``python -m bench`` lists them (bench/__main__.py); each is one module defining ``BENCHMARK``, the
shared pieces are in ``bench/common.py``, recorded figures in ``bench/records.json`` (``bench/records.py``)."""
