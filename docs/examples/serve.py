"""A small HTTP service around one pruneflow artifact: JSON in, JSON out, dynamic batching, live /metrics.

    python docs/examples/serve.py runs/resnet56-cifar10-ptq/export/openvino/model.int8.xml --port 8080 --metrics-port 9464
    curl -s localhost:8080/predict -d '{"input": [[[0.1, ...]]]}'        # one sample, without its batch axis
    curl -s localhost:9464/metrics | grep pruneflow_request_latency      # what Prometheus scrapes

POST /predict takes one sample as a JSON object of input name -> nested list (or {"input": ...} for a one-input
model) and answers {"output": ...}, or {"HEAD": ...} per head of a multi-head model. Requests from concurrent
clients are batched by the server (--max-batch, --max-delay-ms). SIGINT/SIGTERM stop taking requests, answer
the queued ones, then exit. Standard library only, besides pruneflow: put it behind your own gateway for TLS/auth.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from pruneflow.runtime import BatchPolicy, Server, ServerClosed
from pruneflow.runtime.metrics import ServingMetrics, serve_metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", help="an .onnx or OpenVINO .xml written by `pruneflow optimize`")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--metrics-port", type=int, default=9464)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)

    runtime = "openvino" if args.artifact.endswith(".xml") else "onnxruntime"
    metrics = ServingMetrics.for_artifact(args.artifact, runtime=runtime, device=args.device)
    server = Server.open(args.artifact, device=args.device, policy=BatchPolicy(args.max_batch, args.max_delay_ms),
                         threads=args.threads, workers=args.workers, metrics=metrics)
    endpoint = serve_metrics(metrics.registry, args.metrics_port)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/predict":
                return self._answer(404, {"error": "POST /predict"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                sample = {k: np.asarray(v) for k, v in body.items()}
                answer = server.submit(sample).result(timeout=30)
            except ServerClosed as exc:
                return self._answer(503, {"error": exc.message})
            except (ValueError, TypeError, KeyError) as exc:
                return self._answer(400, {"error": str(exc)})
            except Exception as exc:  # noqa: BLE001 - the pruneflow error's message, as the client's 400
                return self._answer(400, {"error": getattr(exc, "message", str(exc))})
            out = {k: v.tolist() for k, v in answer.items()} if isinstance(answer, dict) else {"output": answer.tolist()}
            self._answer(200, out)

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:  # the metrics say what the access log would
            pass

    http = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"serving {args.artifact} ({server.label}) on http://127.0.0.1:{http.server_address[1]}/predict; "
          f"metrics on {endpoint.url}", flush=True)

    def stop(*_: object) -> None:
        threading.Thread(target=http.shutdown, daemon=True).start()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        http.serve_forever()
    finally:
        server.close(drain=True)  # answer what was queued, then stop
        endpoint.close()
        http.server_close()


if __name__ == "__main__":
    main()
