"""Running sparkstep on more than one host: Spark's own standalone cluster daemons
(:mod:`sparkstep.cluster.spark`)."""
