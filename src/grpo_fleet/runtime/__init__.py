"""Process-wide helpers: the BLAS switch, the doctor, durable writes, digests, exit codes, the run lock, checkpoint
directories and typed parameter trees."""
