"""hloserve's benchmarks: `python -m benches [SCENARIO...]` (or `tox -e bench`)."""
