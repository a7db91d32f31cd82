"""Tools beside the runtime: the collectives benchmark (``bench``, its worker,
``gpu_bench``), figures, the cost model's calibration (``calibrate``), the
launchers of multi-process jobs (``launch``) and simulated hosts (``netns``), and the
reader of profiler traces (``trace_summary``: which collectives ran, where, beside what).
``import jax_smddp`` loads none of them."""
