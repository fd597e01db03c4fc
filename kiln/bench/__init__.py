"""The benchmark harness behind `kiln bench` (latency, throughput, serve, compile,
kernels, ...) and the writer of the kernel tuning table (`tuning.merge_into`; the runtime
reads the table through `kiln.ops.tuning`). The modes live in their own modules and load
on demand."""
