"""Python's standard gRPC client against keel serve's shipping service.

Usage: shipping_client.py HOST:PORT PROTO_DIR

Compiles the checked-in proto with grpcio-tools, then calls every method
the way ordinary Python clients do (a timeout that becomes grpc-timeout,
traceparent metadata), and prints one JSON object: what it saw. Exits
non-zero on the first check that fails, saying which.
"""

import json
import os
import queue
import sys
import tempfile

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_tools import protoc

ADDRESS, PROTO_DIR = sys.argv[1], sys.argv[2]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
seen = {}


def check(condition, what):
    if not condition:
        print(json.dumps({"failed": what, "seen": seen}))
        sys.exit(1)


def compile_stubs():
    out = tempfile.mkdtemp()
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    code = protoc.main([
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "shipping/v1/shipping.proto",
    ])
    check(code == 0, "grpcio-tools compiles the proto")
    sys.path.insert(0, out)
    from shipping.v1 import shipping_pb2, shipping_pb2_grpc

    return shipping_pb2, shipping_pb2_grpc


pb, rpc = compile_stubs()
channel = grpc.insecure_channel(ADDRESS)
stub = rpc.ShippingStub(channel)
meta = (("traceparent", TRACEPARENT),)

# Health, as a load balancer asks.
health = health_pb2_grpc.HealthStub(channel)
status = health.Check(
    health_pb2.HealthCheckRequest(service="shipping.v1.Shipping"), timeout=2
).status
seen["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
check(status == health_pb2.HealthCheckResponse.SERVING, "health says SERVING")

# Create, twice under one request id: one shipment.
request = pb.CreateShipmentRequest(order_id="py-1", request_id="py-1:schedule_shipment")
first = stub.CreateShipment(request, timeout=2, metadata=meta)
again = stub.CreateShipment(request, timeout=2, metadata=meta)
seen["created"] = first.id
check(first.id == again.id, "a repeated create returns the same shipment")
check(first.status == pb.Shipment.STATUS_PICKED, "a new shipment is picked")

# Too little time left: the server does not start (it needs 50 ms).
try:
    stub.CreateShipment(
        pb.CreateShipmentRequest(order_id="py-2", request_id="py-2:k"), timeout=0.02
    )
    check(False, "a create with 20 ms left is refused")
except grpc.RpcError as e:
    seen["too_late"] = e.code().name
    check(e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, "too late is DEADLINE_EXCEEDED")

# Bad input and unknown ids get their codes.
for bad, code in (
    (pb.GetShipmentRequest(id=""), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GetShipmentRequest(id="shp-nobody"), grpc.StatusCode.NOT_FOUND),
):
    try:
        stub.GetShipment(bad, timeout=2)
        check(False, f"GetShipment({bad.id!r}) fails")
    except grpc.RpcError as e:
        check(e.code() == code, f"GetShipment({bad.id!r}) is {code.name}")

# Client streaming: the summary once our stream ends.
scans = [
    pb.Scan(shipment_id=first.id, scan_id="py-s1", location="Leeds"),
    pb.Scan(shipment_id=first.id, scan_id="py-s1", location="Leeds"),
    pb.Scan(shipment_id="shp-nobody", scan_id="py-s2", location="York"),
]
summary = stub.UploadScans(iter(scans), timeout=2)
seen["upload"] = [summary.received, summary.applied, summary.duplicates, summary.refused]
check(seen["upload"] == [3, 1, 1, 1], "the upload summary counts each scan")

# Bidirectional: a scan acknowledged, its event acknowledged back.
outbox = queue.Queue()
outbox.put(pb.ClientMsg(scan=pb.Scan(shipment_id=first.id, scan_id="py-s3", location="Hull")))
replies = stub.Sync(iter(outbox.get, None), timeout=5)
kinds = []
for reply in replies:
    kind = reply.WhichOneof("kind")
    kinds.append(kind)
    if kind == "event":
        ack = pb.EventAck(shipment_id=reply.event.shipment_id, sequence=reply.event.sequence)
        outbox.put(pb.ClientMsg(ack=ack))
        outbox.put(None)  # our side is done; the server ends its side after
seen["sync"] = kinds
check(kinds == ["scan_ack", "event"], "Sync acknowledges the scan and sends its event")

# Server streaming, dropped after one event and resumed after it.
events = []
stream = stub.WatchShipment(pb.WatchShipmentRequest(id=first.id), timeout=10, metadata=meta)
events.append(next(stream))
stream.cancel()
resumed = stub.WatchShipment(
    pb.WatchShipmentRequest(id=first.id, after_sequence=events[-1].sequence), timeout=10
)
events.extend(resumed)
sequences = [e.sequence for e in events]
seen["watch"] = sequences
check(sequences == list(range(1, len(sequences) + 1)), "no gap, no duplicate")
check(events[-1].status == pb.Shipment.STATUS_DELIVERED, "the watch ends delivered")
check(all(e.status != pb.Shipment.STATUS_UNSPECIFIED for e in events), "never unset")

print(json.dumps({"ok": True, "seen": seen}))
