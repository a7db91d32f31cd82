"""Tools beside the runtime: the collectives benchmark (``bench``, its worker,
``gpu_bench``), figures, the cost model's calibration (``calibrate``), and the
launchers of multi-process jobs (``launch``) and simulated hosts (``netns``).
``import jax_smddp`` loads none of them."""
