"""Building blocks of the serving benchmark (``python -m benchmarks.serving``): workloads, the streamed
request client, the load driver, statistics, reporting and launching pdserve."""
