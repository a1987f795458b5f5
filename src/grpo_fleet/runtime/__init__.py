"""Process-wide helpers: the BLAS switch, the doctor, durable writes, digests, exit codes, the run lock, checkpoint
directories, typed parameter trees, the guarded child process that rewards and environments run in, and transformers'
import walk read from a cache file."""
