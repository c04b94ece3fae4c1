"""Container health probe: `python -m services.common.healthcheck HOST:PORT [SERVICE]` exits 0 when SERVING."""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"{target}: {exc.code().name}", file=sys.stderr)
            return False
    print(f"{target} {service or '(server)'}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if check(argv[0], argv[1] if len(argv) > 1 else "") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
