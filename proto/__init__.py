"""conveyor's cross-process contract: config, sampling params, messages, codec, sockets."""
