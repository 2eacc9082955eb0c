"""The monitor's HTTP service: JSON API, uploads, /metrics and the dashboard, in one FastAPI app."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypedDict
from urllib.parse import parse_qsl

import msgspec
from fastapi import Depends, FastAPI, Path as PathParam, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse as _JSONResponse, Response, \
    StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stragglers.errors import InputError
from stragglers.monitor.coalesce import ClientPace, SharedRender
from stragglers.monitor.events import ChangeFeed
from stragglers.monitor.ingest_http import HTTPProblem, add_upload_routes, plain_number
from stragglers.monitor.metrics import CONTENT_TYPE
from stragglers.monitor.parts import MAX_PART, MAX_RANK, MAX_WINDOW, check_job_name, \
    is_job_name
from stragglers.monitor.records import WindowRow, plain
from stragglers.monitor.store_base import job_shape
from stragglers.monitor.service import Monitor
from stragglers.monitor.windows import stuck_window_reads
from stragglers.serving import canonical_decimal, error_status
from stragglers.serving_guard import admit_body
from stragglers.serving_quota import AnonymousPace
from stragglers.wording import printable_all

log = logging.getLogger(__name__)
REFUSAL_PAUSE_S = 0.25   # before a refused upload's answer (see _problem)
JOB_RENDERS = 256   # (job, window, history) pages whose shared renders are kept
READ_THREADS = 4   # threads answering reads of the store (each holds its own connection)
ALERTS_PAGE, ALERTS_PAGE_MAX = 100, 1000   # /api/alerts: alerts a page by default, at most
MAX_CURSOR = 256   # characters of a fingerprint a cursor carries (the alerts' own are 16)
# requests without the token, whatever their route (serving_quota.AnonymousPace): one client
# address's at this pace a second after a burst of twice as many (a browser loads the
# dashboard's five files at once; a script's one-at-a-time loop of reads is paced too), all
# addresses' at four times that, waited for up to 8 s; with read_interval_s 0 (reads not
# paced) none are
ANONYMOUS_PER_S, ANONYMOUS_BURST, ANONYMOUS_MAX_WAIT_S = 32.0, 64.0, 8.0
ANONYMOUS_PER_S_IN_ALL = 128.0

STATIC = Path(__file__).parent / "static"


class JobList(TypedDict):
    """GET /api/jobs: the store's version (pages poll it) and each job's summary row, its
    directory left out."""

    version: int
    jobs: list[dict[str, object]]


INDEX_PAGE, JOB_PAGE = STATIC / "index.html", STATIC / "job.html"


class JSONResponse(_JSONResponse):
    """Starlette's JSON answer, whose strings may hold a file name that is not UTF-8 (a run
    folder named b'run-\\xff' in a refusal, a job's directory): such a name's surrogate escape
    is written as its byte, \\xff (wording.printable), where it made every /api/stats a 500
    (red team round 9 F5). Only an answer that needs it is walked again."""

    def render(self, content: object) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return super().render(printable_all(content))


def plotly_js() -> Path:
    """plotly.min.js as bundled with the installed plotly package (served locally: offline)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def create_app(monitor: Monitor, token: str | None = None, private: bool = False
               ) -> "UploadFastPath":
    """The app (the FastAPI app behind the upload fast path); with a token, writes need it
    (and reads too when `private`)."""
    # (no redirect of '/api/jobs/' to '/api/jobs': a 307 with an empty body, its Location
    # built from the client's Host, answered even a write without its token; 404 instead)
    app = FastAPI(title="stragglers monitor", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    store = monitor.store
    feed = ChangeFeed(store)
    app.state.change_feed = feed
    # reads of the store are answered on these threads, never on the event loop: one
    # /api/alerts or /api/jobs of thousands of jobs (anonymous unless --private) held every
    # other request there, /health and uploads included, until it was encoded
    readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="stragglers-monitor-read")
    app.state.readers = readers

    async def off_loop(fn) -> Response:
        """fn()'s answer (a JSON body or a Response), run and encoded on a reader thread."""
        def run() -> Response:
            body = fn()
            return body if isinstance(body, Response) else JSONResponse(body)
        return await asyncio.get_running_loop().run_in_executor(readers, run)

    def has_token(request: Request) -> bool:
        """Whether the request carries the service's token (True when it has none)."""
        if token is None:
            return True
        got = request.headers.get("authorization", "")
        scheme, _, value = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), token.encode())

    def credentialed(scope) -> bool:
        """Whether a request is paced by the upload limits rather than as anonymous: it
        carries the token (without one configured: an upload, a PUT under /api/jobs/)."""
        if token is None:
            return scope.get("method") == "PUT" and scope.get("path", "").startswith("/api/jobs/")
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, got = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(got, token.encode())
        return False

    if monitor.config.read_interval_s > 0:
        # (taken by the serving layer's ServiceGuard, before any of a request is done)
        app.state.anonymous_pace = AnonymousPace(credentialed, ANONYMOUS_PER_S,
                                                 ANONYMOUS_BURST,
                                                 max_wait_s=ANONYMOUS_MAX_WAIT_S,
                                                 per_s_in_all=ANONYMOUS_PER_S_IN_ALL)

    def require_write(request: Request) -> None:
        if not has_token(request):
            raise HTTPProblem(401, "request header 'Authorization': missing or wrong bearer "
                              "token", "unauthorized")

    def require_read(request: Request) -> None:
        if private:
            require_write(request)

    @app.exception_handler(HTTPProblem)
    async def _problem(request: Request, exc: HTTPProblem):
        monitor.reject(exc.reason, f"{request.method} {request.url.path}", exc.message)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        if exc.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(exc.retry_after_s + 0.5)))
        if exc.close or exc.status == 401:
            # the body may be unread: close rather than read (up to 64 MiB) to throw it away
            headers["Connection"] = "close"
        if exc.status in (413, 429) or exc.reason in ("bad_part", "unauthorized"):
            # a client looping on refused uploads (past its limits, junk, lying parts, a
            # wrong token) waits instead of spinning the CPUs other jobs' uploads need
            await asyncio.sleep(REFUSAL_PAUSE_S)
        body = {"error": exc.message}
        if exc.reason == "superseded_run":   # (the recorder's uploader stops on this kind)
            body["kind"] = exc.reason
        return JSONResponse(body, status_code=exc.status, headers=headers)

    @app.exception_handler(InputError)
    async def _input(request: Request, exc: InputError):
        monitor.reject("bad_request", f"{request.method} {request.url.path}", str(exc))
        return JSONResponse({"error": str(exc), "field": exc.field}, status_code=422)

    async def upload(request: Request, job: str, rank: int, part: int) -> Response:
        """The part upload as its route runs it (token, then the endpoint), errors included."""
        try:
            require_write(request)
            return JSONResponse(await store_part(request, job, rank, part))
        except HTTPProblem as exc:
            return await _problem(request, exc)
        except InputError as exc:
            return await _input(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = list(err.get("loc", ()))
        kind = loc.pop(0) if loc else "request"
        msg = f"{kind} parameter '{'.'.join(map(str, loc))}': {err.get('msg', 'invalid')}"
        monitor.reject("bad_request", f"{request.method} {request.url.path}", msg)
        return JSONResponse({"error": msg}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, exc: StarletteHTTPException):
        # no route matched (404) or not with this method (405): the API's own error format,
        # naming the path as the server saw it (a %2F decodes to '/', so a path trick lands here)
        method = "HEAD" if request.scope.get(HEAD_KEY) else request.method
        what = "no such endpoint" if exc.status_code == 404 else \
            f"method {method} is not allowed here" if exc.status_code == 405 else \
            str(exc.detail)
        monitor.reject("bad_request", f"{request.method} {request.url.path}", what)
        return JSONResponse({"error": f"path {request.url.path[:200]!r}: {what}"},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(msgspec.ValidationError)
    async def _damaged(request: Request, exc: msgspec.ValidationError):
        # a stored row that does not read (damaged in the store, or written by a version with
        # other types): that job's reads are refused, naming it, and every other job is served
        job = request.path_params.get("job")
        what = f"job {str(job)[:128]!r}" if job else "this read"
        message = f"path {request.url.path[:200]!r}: a stored row of {what} does not read " \
            f"({str(exc)[:160]}); expected rows as this version writes them"
        monitor.reject("damaged_row", f"{request.method} {request.url.path}", message)
        return JSONResponse({"error": message}, status_code=409)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception):
        # a full disk (507), storage that fails (503) or a bug (500): the API's error shape,
        # one line in the log, no traceback in the answer (serving.ServiceGuard for the rest)
        status, message = error_status(exc)
        monitor.reject("storage" if status != 500 else "internal",
                       f"{request.method} {request.url.path}", message)
        return JSONResponse({"error": message}, status_code=status)

    read = [Depends(require_read)]
    store_part = add_upload_routes(app, monitor, require_write)

    @app.get("/health")
    async def health(request: Request):
        """Liveness: answers while the service runs (from the start: `scanning` while the
        watched roots' first scan is under way; `stuck_reads`: file reads given up on and
        still held); when `private`, without the token only that it is up (the job counts
        are a read like the others)."""
        if private and not has_token(request):
            return {"ok": True}
        return {"ok": True, "jobs": len(monitor.directories), "idle": monitor.idle(),
                "scanning": monitor.scanning(),
                # watched files whose read passed read_timeout_s and is still held (a hung
                # NFS or FUSE file): their threads are left behind, up to MAX_STUCK_READS on
                # the monitor's readers and as many on the windows' (said 0 for a window's)
                "stuck_reads": len(monitor.file_readers.stuck) + len(stuck_window_reads()),
                "instance": monitor.instance, "jobs_held": len(monitor.leases.held)} \
            | ({"uploads_refused": monitor.unshared} if monitor.unshared else {})

    def render_metrics() -> bytes:
        monitor.refresh_metrics()
        return monitor.metrics.render()

    # scrapes share renders, at a bounded share of the CPU (coalesce.py: a loop of scrapes
    # with no token slowed every upload 16x)
    metrics_render = SharedRender(lambda: asyncio.get_running_loop().run_in_executor(
        readers, render_metrics))

    async def waited_turn(pace: ClientPace, request: Request) -> Response | None:
        """None once the client's turn came; the 503 when its connection closed first (or
        its client shut its side, then it reads this, or a connection cap closed it: no turn
        taken, nothing rendered)."""
        if await pace.turn(request.scope):
            return None
        return JSONResponse({"error": "request: its connection was closed (or its client's "
                             "side shut) while it waited its turn; retry on an open "
                             "connection"}, status_code=503)

    def paced(render: SharedRender[bytes], media_type: str):
        """A route's answer from `render`, one a client address per read_interval_s."""
        pace = ClientPace(monitor.config.read_interval_s)

        async def answer(request: Request) -> Response:
            if (closed := await waited_turn(pace, request)) is not None:
                return closed
            return Response(await render.get(), media_type=media_type)
        return answer

    metrics_answer = paced(metrics_render, CONTENT_TYPE)

    @app.get("/metrics", dependencies=read)
    async def metrics(request: Request):
        """Prometheus text exposition (every job's, whichever instance analyses it)."""
        return await metrics_answer(request)

    def shared_json(fn) -> SharedRender[bytes]:
        """fn()'s JSON, encoded on a reader thread, one render shared by the requests that
        wait for it (the same answer for everyone: 8 loops reading the job list slowed a
        recorder's uploads 4.6x)."""
        return SharedRender(lambda: asyncio.get_running_loop().run_in_executor(
            readers, lambda: bytes(JSONResponse(fn()).body)))

    def job_list() -> JobList:
        # the server's directories stay on the server: readers of the list get job names
        return {"version": store.version, "jobs": [
            {k: v for k, v in plain(j).items() if k != "directory"}
            | ({"state": "quarantined"} if j.job in monitor.quarantined else {})
            for j in store.jobs()]}

    job_list_render = shared_json(job_list)

    jobs_answer = paced(job_list_render, "application/json")

    @app.get("/api/jobs", dependencies=read)
    async def jobs(request: Request):
        """Every job: name, world size, current S, state, last update, open alerts."""
        return await jobs_answer(request)

    # a job's page grows with its windows (566 KB, 0.23 s at 2,000): answered to one client
    # address once per read_interval_s, and one render shared by the requests asking the same
    # page (8 anonymous loops of it slowed another job's uploads 20x); the alerts' pages
    # (up to 1,000 alerts and 1,000 log entries) are paced too; a window's page (one window,
    # answered at once: the dashboard's click, a poll for a window) is not
    job_pace, alerts_pace = ClientPace(monitor.config.read_interval_s), \
        ClientPace(monitor.config.read_interval_s)
    job_renders: OrderedDict[tuple[str, int | None, int], SharedRender[bytes]] = OrderedDict()

    def job_render(key: tuple[str, int | None, int]) -> SharedRender[bytes]:
        """The shared render of one (job, window, history) page (the latest JOB_RENDERS)."""
        render = job_renders.pop(key, None) or shared_json(lambda: job_answer(*key))
        job_renders[key] = render
        while len(job_renders) > JOB_RENDERS:
            job_renders.popitem(last=False)
        return render

    @app.get("/api/jobs/{job}", dependencies=read)
    async def job(request: Request, job: str = PathParam(max_length=128),
                  window_text: str | None = Query(None, alias="window", max_length=64),
                  history_text: str | None = Query(None, alias="history", max_length=64)):
        """A job: its state, its last `history` windows (summaries; `windows_total` and
        `first_window` tell how many there are), the chosen (default: latest) window, alerts."""
        check_job_name(job, "path")
        window = None if window_text is None else \
            plain_number(window_text, "query 'window'", MAX_WINDOW)
        history = 100_000 if history_text is None else \
            plain_number(history_text, "query 'history'", 100_000)
        if history < 1:
            raise HTTPProblem(422, "query 'history': 0 windows asked for; expected 1..100000",
                              "bad_request")
        if (closed := await waited_turn(job_pace, request)) is not None:
            return closed
        return Response(await job_render((job, window, history)).get(),
                        media_type="application/json")

    def job_answer(job: str, window: int | None, history: int) -> object:
        row = store.job(job)
        if row is None:
            raise HTTPProblem(404, f"path 'job': unknown job {job!r}", "unknown_job")
        shape = job_shape(row.meta)
        tracker = monitor.trackers.get(job)
        chosen = store.window(job, window) if window is not None else store.last_window(job)
        if window is not None and chosen is None:
            raise HTTPProblem(404, f"query 'window': job {job!r} has no window {window}",
                              "unknown_window")
        return plain({
            "version": store.version, "job": job, "state": monitor.states.get(job, row.state),
            "way": row.way, "created_at": row.created_at,
            "quarantined": monitor.quarantined.get(job),
            "last_part_at": row.last_part_at, "dp": shape.dp_size,
            "pp": shape.pp_size, "world_size": shape.world_size,
            "window_steps": _window_steps(store.last_window(job), monitor.config.window_steps),
            "pending_rows": tracker.pending_rows if tracker else 0,
            "skipped_parts": tracker.skipped_parts() if tracker else 0,
            "upload_dropped": store.upload_dropped(job),
            "windows": store.windows(job, history), "window": chosen,
            **dict(zip(("windows_total", "first_window"), store.window_span(job))),
            "alerts": store.alerts(job=job, status="firing"),
            "alert_log": store.alert_log(job=job)})

    @app.get("/api/jobs/{job}/windows/{idx}", dependencies=read)
    async def job_window(job: str = PathParam(max_length=128),
                         idx_text: str = PathParam(alias="idx", max_length=64)):
        """One analysed window in full (scores per worker, diagnosis)."""
        check_job_name(job, "path")
        idx = plain_number(idx_text, "path 'idx'", MAX_WINDOW)

        def answer() -> object:
            w = store.window(job, idx)
            if w is None:
                raise HTTPProblem(404, f"path 'idx': job {job!r} has no window {idx}",
                                  "unknown_window")
            return plain(w)
        return await off_loop(answer)

    @app.get("/api/events", dependencies=read)
    async def events():
        """Server-Sent Events: `change` (with the store version) whenever something is stored."""
        if feed.full():
            raise HTTPProblem(503, f"request: {feed.max_subscribers} event streams are open "
                              "already; poll the JSON API instead", "too_many_streams")
        return StreamingResponse(feed.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    @app.get("/api/alerts", dependencies=read)
    async def alerts(request: Request,
                     limit_text: str | None = Query(None, alias="limit", max_length=64),
                     after: str | None = Query(None, max_length=8 * (MAX_CURSOR + 1)),
                     log_before_text: str | None = Query(None, alias="log_before",
                                                         max_length=64)):
        """Alerts firing now and the latest transitions of every job, a page at a time:
        `limit` of each (default ALERTS_PAGE, at most ALERTS_PAGE_MAX); `next` and `log_next`
        read the rest (`?after=`, `?log_before=`)."""
        limit = ALERTS_PAGE if limit_text is None else \
            plain_number(limit_text, "query 'limit'", ALERTS_PAGE_MAX)
        if limit < 1:
            raise HTTPProblem(422, f"query 'limit': 0 alerts asked for; expected "
                              f"1..{ALERTS_PAGE_MAX}", "bad_request")
        fingerprint = None if after is None else _read_cursor(after)
        before = None if log_before_text is None else \
            plain_number(log_before_text, "query 'log_before'", MAX_WINDOW)

        def answer() -> object:
            firing, cursor = store.alerts_page("firing", fingerprint, limit)
            entries, older = store.alert_log_page(before, limit)
            return plain({"firing": firing, "next": _cursor(cursor), "log": entries,
                          "log_next": older})
        if (closed := await waited_turn(alerts_pace, request)) is not None:
            return closed
        return await off_loop(answer)

    stats_render = shared_json(lambda: plain({**store.totals(),
                                              "rejects": list(monitor.recent_rejects.copy()),
                                              "idle": monitor.idle()}))

    stats_answer = paced(stats_render, "application/json")

    @app.get("/api/stats", dependencies=read)
    async def stats(request: Request):
        """Parts and records stored (per way in and per job), and recent refusals."""
        return await stats_answer(request)

    @app.get("/", dependencies=read)
    async def index():
        """The dashboard: job list."""
        return FileResponse(INDEX_PAGE, media_type="text/html")

    @app.get("/jobs/{job}", dependencies=read)
    async def job_page(job: str = PathParam(max_length=128)):
        """The dashboard: one job."""
        check_job_name(job, "path")
        return FileResponse(JOB_PAGE, media_type="text/html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(status_code=204)

    @app.get("/static/plotly.min.js")
    async def plotly():
        """plotly.js from the installed plotly package."""
        return FileResponse(plotly_js(), media_type="application/javascript")

    @app.get("/static/{name}")
    async def static(name: str = PathParam(pattern=r"^[a-z]+\.(js|css)$")):
        """The dashboard's own script and style."""
        path = STATIC / name
        if not path.is_file():
            raise HTTPProblem(404, f"path 'name': no static file {name!r}", "not_found")
        return FileResponse(path)

    return UploadFastPath(app, upload)


class UploadFastPath:
    """ASGI app: a well-formed `PUT /api/jobs/{job}/ranks/{rank}/parts/{n}` straight to the
    upload endpoint, everything else to the FastAPI app.

    Part uploads are nearly every request the monitor gets; FastAPI's middleware stack, route
    matching and dependency solving took ~2× the CPU of the ingest itself (py-spy, GIL held).
    Only requests whose job name, rank and part number already pass the route's own checks
    take this path, and they run the route's endpoint (token, checks, errors): a malformed one
    goes to the app and gets the app's answer.
    """

    def __init__(self, app: FastAPI, upload):
        self.app, self.upload, self.state = app, upload, app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            # HEAD is allowed wherever GET is (RFC 9110 §9.3.2): the GET route's answer, its
            # status and headers, without the body (each GET route answered HEAD 405)
            scope["method"], scope[HEAD_KEY] = "GET", True
            send = head_only(scope, send)
        twice = repeated_query(scope) if scope["type"] == "http" else None
        if twice is not None:
            # one value per parameter: `?limit=1&limit=1000` was answered with the last one,
            # which a proxy or cache in front, judging by the first, does not expect
            await JSONResponse({"error": f"query {twice[:40]!r}: given more than once; "
                                "expected each parameter once"},
                               status_code=422)(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] != "PUT":
            # only the two PUTs read a body (from read_body, once their head passed): a read
            # declaring one is refused from its head, and any other request is let through
            # (the event stream and the dashboard's files listen for the client's hang-up by
            # reading: uvicorn said 100 Continue to anyone and read what was sent)
            if not declares_body(scope):
                admit_body(scope)
            elif scope["method"] in ("GET", "HEAD"):
                method = "HEAD" if scope.get(HEAD_KEY) else scope["method"]
                await JSONResponse({"error": f"request body: {method} "
                                    f"{scope['path'][:200]!r} takes none; expected no "
                                    "Content-Length or Transfer-Encoding"},
                                   status_code=400)(scope, receive, send)
                return
        elif scope["type"] == "http":
            p = scope["path"].split("/")   # '', api, jobs, JOB, ranks, R, parts, N
            if (len(p) == 8 and p[1] == "api" and p[2] == "jobs" and p[4] == "ranks"
                    and p[6] == "parts" and is_job_name(p[3])
                    and canonical_decimal(p[5], MAX_RANK) is not None
                    and canonical_decimal(p[7], MAX_PART) is not None):
                response = await self.upload(Request(scope, receive), p[3], int(p[5]),
                                             int(p[7]))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


HEAD_KEY = "stragglers.head"   # (in a request's scope: it came as HEAD, answered as GET)


def head_only(scope, send):
    """`send` for a HEAD request answered by its GET route: the method is HEAD again once the
    answer starts (the server then sends no body and keeps its Content-Length), and the first
    body message ends the answer (an event stream's would go on for good)."""
    done = False

    async def send_head(message) -> None:
        nonlocal done
        if message["type"] == "http.response.start":
            scope["method"] = "HEAD"
        elif message["type"] == "http.response.body":
            if done:
                return
            done = True
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(message)
    return send_head


def repeated_query(scope) -> str | None:
    """The first query parameter a request names twice (after percent-decoding), or None."""
    text = scope.get("query_string") or b""
    if b"&" not in text:
        return None
    seen: set[str] = set()
    for name, _ in parse_qsl(text.decode("latin-1"), keep_blank_values=True):
        if name in seen:
            return name
        seen.add(name)
    return None


def declares_body(scope) -> bool:
    """Whether a request declares a body (a Content-Length above 0, or a transfer coding)."""
    for name, value in scope.get("headers") or ():
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" 0")):
            return True
    return False


def _cursor(fingerprint: str | None) -> str | None:
    """The `after` cursor of /api/alerts: the last fingerprint of a page, hex-encoded (any
    stored text passes a query unchanged)."""
    if fingerprint is None:
        return None
    if len(fingerprint) > MAX_CURSOR:   # (a damaged row's: past every text it begins)
        fingerprint = fingerprint[:MAX_CURSOR] + chr(0x10FFFF)
    return fingerprint.encode().hex()


def _read_cursor(text: str) -> str:
    """A cursor given back as `after`; 422 naming it when it is not one."""
    try:
        return bytes.fromhex(text).decode() if len(text) % 2 == 0 and \
            all(c in "0123456789abcdef" for c in text) else _not_a_cursor(text)
    except UnicodeDecodeError:
        return _not_a_cursor(text)


def _not_a_cursor(text: str) -> str:
    raise HTTPProblem(422, f"query 'after': {text[:40]!r} is not a cursor; expected the `next` "
                      "of an earlier /api/alerts answer", "bad_request")


def _window_steps(last: WindowRow | None, configured: int) -> int:
    """Steps per window as the job's windows were cut (its last complete window), else as
    configured now: a store served again without the rules it was made with said "windows of
    10 steps" for 5-step windows."""
    if last is not None and last.reason == "complete" and last.steps:
        # (a step left out of the analysis is not in `steps`: one at the window's either end,
        # the last step's op judged past the others', counts by first_step/last_step)
        return len(last.steps) + (last.steps[0] != last.first_step) \
            + (last.steps[-1] != last.last_step)
    return configured

