"""In-sandbox TCP -> Unix-socket forwarder (stdlib only; run by the sandbox's /usr/bin/python3).

usage: python3 forwarder.py PORT SOCKET_PATH
Listens on 127.0.0.1:PORT inside the sandbox's network namespace and copies the
bytes of each connection to and from a new connection to SOCKET_PATH (a Unix
socket bind-mounted from the host). Bytes are forwarded as they arrive (no
buffering), so streamed (SSE) responses stay streamed. Prints "READY" once
listening. Lifecycle: runs until killed with the sandbox.
"""

import socket
import sys
import threading


def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def serve_one(conn, path):
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        conn.close()
        upstream.close()
        return
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
    back.start()
    pump(conn, upstream)
    back.join()
    conn.close()
    upstream.close()


def main():
    port, path = int(sys.argv[1]), sys.argv[2]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve_one, args=(conn, path), daemon=True).start()


if __name__ == "__main__":
    main()
