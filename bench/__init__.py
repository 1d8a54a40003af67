"""``make bench``: the driver (make_bench.py) and the report writer (report.py)."""
