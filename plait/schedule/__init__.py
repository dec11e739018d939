"""Pipeline schedules as plain data, torch-free and at the bottom: which action each rank runs
and in which order (build.py), what one action is (action.py), and a timed schedule with its
pictures (timeline.py). The runner (plait.parallel.pipeline) executes these lists and the
estimator (plait.estimate.pipeline) times them, so both read one definition."""
