"""kverr benchmarks: the registry and runner (bench.run), the long results table and its README table (bench.table)."""
