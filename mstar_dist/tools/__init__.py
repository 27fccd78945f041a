"""Tools beside the runtime, which no serving process imports: the bare batched decode loop that the benchmarks
compare the served deployments against (``bare_loop``), and the GGUF importer that prepares a Llama-family
checkpoint directory (``gguf_import``)."""
