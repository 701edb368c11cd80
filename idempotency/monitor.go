package idempotency

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/saferetry/saferetry/internal/monitor"
	"github.com/saferetry/saferetry/keygen"
)

// monitorRetryAfter is the Retry-After, in seconds, of an answer that says
// an operation is in progress: the 202 of WithAcceptAfter and the monitor's.
const monitorRetryAfter = "1"

// Monitor returns the status monitor of m's requests: an http.Handler to
// mount at WithMonitor's path, for GET and HEAD, that reads the store and
// never runs a handler. It answers two questions, each scoped by the
// principal of the monitor's own request (WithPrincipal), exactly as a
// request is:
//
//   - GET <path><identifier>: what became of the operation a 202 or an
//     in-progress 409 pointed to (Location);
//   - GET <path> with the key in the key header (never in the URL) and
//     "Idempotency-Lookup: <method> <request target>" (for example
//     "POST /payments"): what became of the request sent with that key, a
//     lookup by key that needs no identifier and no WithMonitor.
//
// The answer: in progress, 202 with Retry-After: 1 and a status body
// ({"status":"in_progress","age_ms":...,"monitor":...}, the monitor URL
// when WithMonitor is set); completed, the stored response as a replay of
// the request gives it (status, allow-listed headers and body byte for
// byte, Idempotent-Replayed: true), but with Cache-Control: no-store;
// absent (never seen, past the replay window, another principal's, an
// identifier that names nothing), 404 CodeRequestAbsent, the same answer
// whichever it is, so that it tells another principal nothing. A lookup
// cannot check the request's fingerprint, which covers the body it does not
// carry: a completed answer is the response of whichever request used the
// key in that scope. The other answers are the middleware's problems: 400
// CodeKeyMissing, CodeKeyInvalid or CodeLookupInvalid, 405 CodeLookupInvalid
// (another method), 401 and 503 for the principal, 503 for the store.
//
// routes is the handler the guarded requests are served by (the
// *http.ServeMux they are registered on): a lookup names its request's
// route as the middleware named it, through the mux's pattern for the
// method and target it gives, and the route the middleware's own Wrap
// then takes (WithRoute's function, when set, instead). A router that is
// not an *http.ServeMux cannot be asked: give WithRoute, or the lookup
// names the route by the target's path. The Monitor is safe for
// concurrent use.
func (m *Middleware) Monitor(routes http.Handler) http.Handler {
	return &monitorHandler{m: m, routes: routes}
}

type monitorHandler struct {
	m      *Middleware
	routes http.Handler
}

func (mh *monitorHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	m, ctx := mh.m, r.Context()
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		m.refuse(ctx, w, Scope{}, http.StatusMethodNotAllowed, CodeLookupInvalid,
			"the monitor answers GET and HEAD", nil)
		return
	}
	principal, ok := m.principalOf(w, r, Scope{})
	if !ok {
		return
	}
	var op operation
	id := r.URL.Path[strings.LastIndexByte(r.URL.Path, '/')+1:]
	if id != "" {
		var err error
		if op, err = m.cfg.monitorIDs.open(principal, id); err != nil {
			writeProblem(w, http.StatusNotFound, CodeRequestAbsent, "", 0)
			return
		}
	} else if op, ok = mh.lookup(w, r); !ok {
		return
	}
	s := Scope{Principal: principal, Method: op.method, Route: op.route, Key: op.key}
	rec, err := m.g.get(ctx, kindGet, s)
	switch {
	case errors.Is(err, ErrNotFound), err == nil && !m.monitored(op, rec, id != ""):
		writeProblem(w, http.StatusNotFound, CodeRequestAbsent, "", 0)
	case err != nil:
		m.refuseStore(ctx, w, s, err)
	case rec.State == Completed:
		m.replay(ctx, &noStore{ResponseWriter: w}, s, rec)
	default:
		inProgress(w, m.monitorURL(s, rec), rec)
	}
}

// monitored reports whether the monitor answers with rec for op: a record
// of a request (not a call of Do), within the replay window when
// completed, and, found by identifier, made by op's request.
func (m *Middleware) monitored(op operation, rec Record, byID bool) bool {
	switch {
	case rec.State == Absent, byID && !op.matches(rec):
		return false
	case rec.State == Completed:
		return m.cfg.replayWindow <= 0 || time.Since(rec.CompletedAt) <= m.cfg.replayWindow
	}
	return true
}

// lookup reads a lookup by key from r: the key header and the
// Idempotency-Lookup header, whose route it names as the middleware does.
// It answers r with the refusal and reports false when it cannot.
func (mh *monitorHandler) lookup(w http.ResponseWriter, r *http.Request) (operation, bool) {
	m, ctx := mh.m, r.Context()
	invalid := func(status int, code Code, detail string) (operation, bool) {
		m.refuse(ctx, w, Scope{}, status, code, detail, nil)
		return operation{}, false
	}
	vals := r.Header.Values(m.cfg.header)
	if len(vals) == 0 {
		return invalid(http.StatusBadRequest, CodeKeyMissing,
			"a lookup names its request's key in the "+m.cfg.header+" header")
	}
	key, err := keygen.ParseHeader(vals)
	if err != nil {
		return invalid(http.StatusBadRequest, CodeKeyInvalid, m.cfg.header+": "+err.Error())
	}
	targets := r.Header.Values(monitor.LookupHeader)
	if len(targets) != 1 {
		return invalid(http.StatusBadRequest, CodeLookupInvalid,
			"a lookup names its request in one "+monitor.LookupHeader+
				` header: "<method> <target>", such as "POST /payments"`)
	}
	method, target, _ := strings.Cut(strings.TrimSpace(targets[0]), " ")
	method = strings.ToUpper(method)
	u, err := url.ParseRequestURI(target)
	switch {
	case !m.cfg.methods[method]:
		return invalid(http.StatusBadRequest, CodeLookupInvalid,
			"the middleware guards no request of method "+strconv.Quote(method))
	case err != nil || !strings.HasPrefix(target, "/"):
		return invalid(http.StatusBadRequest, CodeLookupInvalid,
			"the request target of a lookup is a path, with its query if any")
	}
	lr, err := http.NewRequestWithContext(ctx, method, "/", nil)
	if err != nil {
		return invalid(http.StatusBadRequest, CodeLookupInvalid, "")
	}
	lr.URL, lr.Host, lr.RequestURI, lr.Header = u, r.Host, target, r.Header
	route, ok := mh.route(lr)
	if !ok {
		return invalid(http.StatusBadRequest, CodeLookupInvalid,
			"no route of the server serves "+method+" "+u.EscapedPath())
	}
	return operation{method: method, route: route, key: key}, true
}

// route names the route of lr, a request rebuilt from a lookup, as Wrap
// would name it: WithRoute's function; else, through routes when it is an
// *http.ServeMux, its pattern and the route the middleware's handler takes
// from it; else the path. It reports false when the mux has no route.
func (mh *monitorHandler) route(lr *http.Request) (string, bool) {
	if mh.m.cfg.route != nil {
		return mh.m.cfg.route(lr), true
	}
	mux, ok := mh.routes.(*http.ServeMux)
	if !ok {
		return lr.URL.Path, true
	}
	next, pattern := mux.Handler(lr)
	if pattern == "" {
		return "", false
	}
	lr.Pattern = pattern
	h, ok := next.(*handler)
	if !ok || h.m != mh.m {
		h = &handler{m: mh.m} // the pattern, unless a subtree's: then the path
	}
	return h.route(lr), true
}

// noStore is the ResponseWriter of a replay by the monitor: whatever
// Cache-Control the stored response had, the answer is per principal, and
// no cache keeps it.
type noStore struct{ http.ResponseWriter }

func (n *noStore) WriteHeader(status int) {
	n.Header().Set("Cache-Control", "no-store")
	n.ResponseWriter.WriteHeader(status)
}

// statusBody is the status document of an operation in progress.
type statusBody struct {
	Status  string `json:"status"` // "in_progress"
	AgeMS   int64  `json:"age_ms"` // since the request was first claimed
	Monitor string `json:"monitor,omitempty"`
}

// inProgress answers that the request whose record is rec is in progress:
// 202 Accepted, Retry-After, the status body, and loc, its monitor URL
// (monitorURL), in Location and Operation-Location unless "".
func inProgress(w http.ResponseWriter, loc string, rec Record) {
	h := w.Header()
	if loc != "" {
		h.Set("Location", loc)
		h.Set(monitor.OperationLocation, loc)
	}
	var age time.Duration
	if !rec.CreatedAt.IsZero() {
		age = max(time.Since(rec.CreatedAt), 0)
	}
	body, _ := json.Marshal(statusBody{Status: "in_progress", AgeMS: age.Milliseconds(),
		Monitor: loc}) // strings and ints: cannot fail
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	h.Set("Retry-After", monitorRetryAfter)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusAccepted)
	_, _ = w.Write(body)
}

// monitorURL returns the monitor URL of the request of scope s, whose
// record is rec; "" without WithMonitor, for a call of Do, and for an
// identifier over maxIDLength.
func (m *Middleware) monitorURL(s Scope, rec Record) string {
	if m.cfg.monitorIDs == nil || s.Method == "" || rec.Fingerprint == "" {
		return "" // "": a record nobody can see yet (WithOneTransaction)
	}
	id := m.cfg.monitorIDs.seal(s.Principal, operation{
		method: s.Method, route: s.Route, key: s.Key, fingerprint: rec.Fingerprint})
	if len(id) > maxIDLength {
		return "" // a route of kilobytes: the monitor could not open it
	}
	return m.cfg.monitorPath + id
}

// locate sets Location in h to monitorURL(s, rec), unless "".
func (m *Middleware) locate(h http.Header, s Scope, rec Record) {
	if loc := m.monitorURL(s, rec); loc != "" {
		h.Set("Location", loc)
	}
}

// accepts reports whether guarded requests answer 202 past WithAcceptAfter.
func (m *Middleware) accepts() bool {
	return m.cfg.acceptAfter > 0 && m.cfg.monitorIDs != nil
}

// execEnd is how the goroutine of runAccepting ended.
type execEnd struct {
	s        settled
	returned bool // the handler returned (else it panicked or called runtime.Goexit)
	panicked any  // what it panicked with
}

// runAccepting runs the handler as the owner of res.Record, as run does, on
// a goroutine of its own: when it has not answered WithAcceptAfter after
// the claim, the request answers 202 with its monitor URL and the handler
// runs on, its answer stored and never sent (its writer is detached). When
// the client goes away first, nothing is answered. A panic or
// runtime.Goexit of the handler before either goes on in ServeHTTP's
// goroutine, as without WithAcceptAfter.
func (h *handler) runAccepting(w http.ResponseWriter, r *http.Request, req request,
	res ClaimResult) {
	cw := &capture{w: w, header: make(http.Header)}
	// The handler may outlive ServeHTTP, and its request with it: its own
	// copy, on the context that survives the client.
	r = r.Clone(req.bg)
	loc := h.m.monitorURL(req.scope, res.Record)
	if loc == "" {
		h.run(w, r, req, res, false) // no monitor URL to give: no 202
		return
	}
	done := make(chan execEnd, 1)
	go func() {
		var end execEnd
		defer func() {
			if !end.returned {
				end.panicked = recover()
			}
			done <- end
		}()
		_, end.s = h.exec(cw, r, req, res, false)
		end.returned = true
	}()
	timer := time.NewTimer(h.m.cfg.acceptAfter)
	defer timer.Stop()
	var end execEnd
	select {
	case end = <-done:
	case <-timer.C:
		select {
		case end = <-done: // it answered meanwhile
		default:
			cw.detach()
			inProgress(w, loc, res.Record)
			return
		}
	case <-req.ctx.Done():
		cw.detach() // nobody to answer
		return
	}
	switch {
	case end.returned:
		h.respond(cw, req, end.s)
	case end.panicked != nil:
		panic(end.panicked)
	default:
		runtime.Goexit()
	}
}
