"""The coordinator service over gRPC: protobuf records and frames (codec), the service, its
clients (the rollout agent, the trainer calls) and the coordinator-side GrpcRolloutPort."""
