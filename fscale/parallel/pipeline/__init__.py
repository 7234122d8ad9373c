"""Pipeline parallelism: schedules as data, checked by simulation, run across processes."""
