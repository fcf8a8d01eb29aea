"""Tensor parallelism over torch.distributed: the process group and each rank's place in it
(`parallel_state`), the rank's part of every sharded size and tensor (`sharding`), and the
collectives the sharded layers and the schedulers call (`communication`)."""
