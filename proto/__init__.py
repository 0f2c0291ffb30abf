"""conveyor's cross-process contract: config, sampling params, messages, logprob entries, codec,
sockets, the trace file."""
