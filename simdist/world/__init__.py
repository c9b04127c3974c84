"""Where ranks live: the parallel layout (`spec`), group handles (`groups`), the in-process engine
(`simworld`), real torch.distributed process groups (`torch_comm`) and launchers (`launch`)."""
