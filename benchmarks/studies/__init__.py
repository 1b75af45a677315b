"""One-off studies: each answered a question once (a projection, a calibration, a count); the
standing benchmarks beside this folder are the comparisons the suite reruns."""
