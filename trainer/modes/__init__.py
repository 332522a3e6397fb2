"""The measurement modes: what a run does instead of training, or before it, each entered from
`trainer/run.py` by one call.

    diagnosis      diagnose=true: time the parts of a step (trainer/measure/diagnose.py does the timing)
    profiling      profile=true: a few steps under torch.profiler (trainer/measure/profile.py)
    memory_plan    memory_plan=true: where a step's memory goes at the run's batch (trainer/measure/memory.py)
    batch_finder   data.batch_size=auto: the largest batch that fits

Each measures the run as composed: its plan, its network and the optimizer the plan's recipe
builds, so what is measured is what trains.
"""
