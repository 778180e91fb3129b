"""Container health check: exit 0 when the gRPC health service at HOST:PORT says SERVING.

    python healthcheck.py 127.0.0.1:50061

Docker (HEALTHCHECK in docker/*.Dockerfile) and client/tests/test_compose_processes.py run it.
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Docker's own --timeout is 4 s; answer (or give up) before it kills us.
TIMEOUT_S = 3.0
# A wrong command line in a Dockerfile, as argparse would exit for it.
EXIT_USAGE = 2


def main(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as error:
            print(f"{address}: {error.code().name}", file=sys.stderr)
            return 1
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: healthcheck.py HOST:PORT", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    sys.exit(main(sys.argv[1]))
