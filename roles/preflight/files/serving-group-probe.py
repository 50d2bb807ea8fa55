"""Serving-group network probe (mlafleet preflight, tasks/group.yml): can each member open a TCP
connection to its head's ports on the cluster network? Run with python3 -c on the hosts.

  listen  --addr A --ports P[,P] --seconds S --expect N --head H
      On the head: bind A:P for each port and accept until N members connected to each, or S
      seconds passed. A port something already listens on (the group serves now) is left alone:
      the members then connect to what is there. Prints JSON {problems, ports: {P: state}}.
  connect --addr A --ports P[,P] --seconds S --source IP --member M --head H --ifname I
      On a worker: connect from IP to A:P for each port, retrying until S seconds passed.
      Prints JSON {problems, reached: [P...]}; each problem names the member, the head, the
      address, the port and the interface.
The script always exits 0 with its answer; the play turns problems into refusals.
"""

import argparse
import errno
import json
import select
import socket
import time


def listen(addr, ports, seconds, expect, head):
    problems, state, servers = [], {}, {}
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                state[port] = "in use (the members connect to what holds it)"
                continue
            problems.append(f"head {head} cannot listen on {addr}:{port}: {exc.strerror}"
                            + (f" ({addr} is not an address of {head})" if exc.errno == errno.EADDRNOTAVAIL else ""))
            state[port] = "error"
            continue
        servers[sock] = port
        state[port] = []
    deadline = time.monotonic() + seconds
    while servers and time.monotonic() < deadline:
        ready, _, _ = select.select(list(servers), [], [], max(0.0, deadline - time.monotonic()))
        for sock in ready:
            conn, peer = sock.accept()
            conn.close()
            port = servers[sock]
            state[port].append(peer[0])
            if len(state[port]) >= expect:
                del servers[sock]
                sock.close()
    for sock in servers:
        sock.close()
    return {"problems": problems, "ports": state}


def connect(addr, ports, seconds, source, member, head, ifname):
    problems, reached = [], []
    for port in ports:
        deadline, last = time.monotonic() + seconds, None
        while True:
            try:
                with socket.create_connection((addr, port), timeout=max(1.0, min(5.0, deadline - time.monotonic())),
                                              source_address=(source, 0) if source else None):
                    reached.append(port)
                    break
            except OSError as exc:
                last = exc
                if exc.errno == errno.EADDRNOTAVAIL or time.monotonic() >= deadline:
                    break
                time.sleep(0.5)
        if port not in reached:
            why = getattr(last, "strerror", None) or str(last) or type(last).__name__
            problems.append(f"member {member} cannot reach the head {head} at {addr}:{port} "
                            f"(from {source or 'any address'} over {ifname or 'the default route'}): {why}, "
                            f"tried for {seconds:.0f} s")
    return {"problems": problems, "reached": reached}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["listen", "connect"])
    parser.add_argument("--addr", required=True)
    parser.add_argument("--ports", required=True, type=lambda s: [int(p) for p in s.split(",") if p])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--expect", type=int, default=1)
    parser.add_argument("--source", default="")
    parser.add_argument("--member", default="")
    parser.add_argument("--head", default="")
    parser.add_argument("--ifname", default="")
    args = parser.parse_args(argv)
    if args.mode == "listen":
        result = listen(args.addr, args.ports, args.seconds, args.expect, args.head)
    else:
        result = connect(args.addr, args.ports, args.seconds, args.source, args.member, args.head, args.ifname)
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
