"""The kubelet's gRPC APIs: the .proto files here, and the modules `make proto` generates from them."""
