"""Many runs: device slots and their locks, the jobs a sweep plans, each job's own process, the
parallel and SLURM launchers, and the summary callback. Calls training; results read what it wrote."""
