"""The dtype names the engine runs in, without torch: the command line (`server_args`) offers
them before torch is imported, and `utils` maps them to torch dtypes."""

DTYPE_NAMES = ("bfloat16", "float16", "float32")
