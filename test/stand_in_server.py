"""A stand-in for the launcher in ServerProcess's tests: answers ``/health_generate`` on
``--port``; on a taken port it logs uvicorn's bind error and stays alive, as SGLang's server does
(its scheduler keeps running). ``--child`` starts a child that ignores SIGTERM (a scheduler busy
in a step); ``--crash`` exits after starting it, leaving it behind as a crashed launcher would."""

import argparse
import http.server
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--child", action="store_true")
parser.add_argument("--crash", action="store_true")
args, _ = parser.parse_known_args()

if args.child or args.crash:
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", ignore_term])
    if args.crash:
        sys.exit(3)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass


try:
    server = http.server.HTTPServer((args.host, args.port), Health)
except OSError as e:
    print(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address "
          f"('{args.host}', {args.port}): address already in use", flush=True)
    while True:
        time.sleep(1)
server.serve_forever()
