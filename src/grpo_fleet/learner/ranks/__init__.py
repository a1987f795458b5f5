"""The data-parallel learner: N ranks over `mx.distributed`, their pure sharding and their watched collectives."""
