"""megatron-2bw: PipeDream-2BW / PipeDream-Flush / GPipe pipeline parallelism on megatron-core."""
