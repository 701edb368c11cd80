package natsconsumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/internal/consume"
	"github.com/saferetry/saferetry/keygen"
)

// Message is the message a Func handles: what JetStream delivered, without
// the means to acknowledge it (the Handler does). Header and Data are
// shared: do not modify them.
type Message struct {
	Subject   string
	Header    nats.Header
	Data      []byte
	Stream    string // the stream that stores the message
	Sequence  uint64 // its sequence in the stream
	Delivered int    // how many times it was delivered, this delivery included
}

// Func handles one message through the function door, with the Run of its
// execution (Phase, External, Unit, DownstreamKey). Its writes through
// sqlstore.Tx(ctx) commit with the stored outcome. An error wrapping
// idempotency.ErrDefinitive is stored and dead-letters the message; any
// other error has it redelivered (see the package doc).
type Func func(ctx context.Context, run *idempotency.Run, msg Message) error

// Handler consumes a JetStream consumer's messages through the function
// door. It is safe for concurrent use; its Consume may run in several
// goroutines at once.
type Handler struct {
	mw     *idempotency.Middleware
	fn     Func
	scope  consume.Scope[Message]
	policy consume.Policy
	dlJS   jetstream.JetStream
	dlSubj string
	log    *slog.Logger
}

// Option configures New.
type Option func(*config)

type config struct {
	principal   string
	key, tenant func(Message) (string, error)
	maxAttempts int
	base, cap   time.Duration
	dlJS        jetstream.JetStream
	dlSubj      string
	logger      *slog.Logger
}

// WithPrincipal sets the principal of every message's scope. Default: the
// name of the stream that stores the message, so that two streams never
// share a record.
func WithPrincipal(p string) Option { return func(c *config) { c.principal = p } }

// WithKey sets the function that returns a message's idempotency key, in
// place of its Nats-Msg-Id: an event-derived key such as
// keygen.Event("order-charge", orderID), so that the same business event
// published again under a new message id is the same call. An error of
// key, or a key that keygen.Validate refuses, dead-letters the message
// (reason key_invalid). key must be safe for concurrent use; nil keeps
// the default.
func WithKey(key func(Message) (string, error)) Option {
	return func(c *config) { c.key = key }
}

// WithTenant sets the function that returns the tenant a message belongs
// to (from a header or its subject, say): the principal becomes the
// principal, "/" and the tenant, so that two tenants never share a
// record. A tenant is 1 to 255 bytes of valid UTF-8 without "/"; an error
// or another value dead-letters the message (reason tenant_missing).
// Default: no tenant.
func WithTenant(tenant func(Message) (string, error)) Option {
	return func(c *config) { c.tenant = tenant }
}

// WithMaxAttempts sets how many deliveries a failing message gets before
// it is dead-lettered (reason attempts_exhausted), counted by JetStream
// (NumDelivered, every redelivery included). Default 5; values under 1
// mean 1.
func WithMaxAttempts(n int) Option { return func(c *config) { c.maxAttempts = n } }

// WithBackoff sets the full-jitter backoff (package jitter) between the
// deliveries of a failing message: the delay before delivery n+1 is
// uniform in [0, min(cap, base*2^(n-1))). Default 1 s and 30 s; a
// negative base means 0, a cap of 0 or less means no cap.
func WithBackoff(base, cap time.Duration) Option {
	return func(c *config) { c.base, c.cap = base, cap }
}

// WithDeadLetter sets where dead-lettered messages go: before it
// terminates a message, the Handler publishes a copy to subject through
// js (a subject a stream captures) and waits for its acknowledgement; if
// that fails, the message is redelivered after the backoff instead. See
// the package doc for the copy's headers. Default none: the message is
// only terminated (Term), and stays in its stream as the stream's
// retention keeps it.
func WithDeadLetter(js jetstream.JetStream, subject string) Option {
	return func(c *config) { c.dlJS, c.dlSubj = js, subject }
}

// WithLogger sets the logger (default slog.Default()); nil means no
// logging. Records name a message by its stream, sequence and key digest,
// never its raw key.
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// ErrInvalidConfig is the error of New for an invalid operation, a nil
// Middleware or Func, or an empty dead-letter subject.
var ErrInvalidConfig = errors.New("natsconsumer: invalid configuration")

// New returns a Handler that runs fn for each message through mw.Do, with
// the scope (principal, operation, key) described in the package doc.
// operation names what fn does ("charge"): 1 to 255 bytes of valid UTF-8.
// Errors wrap ErrInvalidConfig.
func New(mw *idempotency.Middleware, operation string, fn Func, opts ...Option) (*Handler,
	error) {
	cfg := config{maxAttempts: consume.DefaultMaxAttempts, base: consume.DefaultBase,
		cap: consume.DefaultCap, logger: slog.Default()}
	for _, o := range opts {
		o(&cfg)
	}
	invalid := func(why string) (*Handler, error) {
		return nil, fmt.Errorf("%w: %s", ErrInvalidConfig, why)
	}
	switch err := consume.CheckOperation(operation); {
	case mw == nil:
		return invalid("nil Middleware")
	case fn == nil:
		return invalid("nil Func")
	case err != nil:
		return invalid(err.Error())
	case cfg.dlJS != nil && cfg.dlSubj == "", cfg.dlJS == nil && cfg.dlSubj != "":
		return invalid("WithDeadLetter needs a JetStream and a subject")
	}
	return &Handler{
		mw: mw, fn: fn,
		scope: consume.Scope[Message]{
			Operation: operation, Principal: cfg.principal,
			Base: func(m Message) string { return m.Stream },
			Key:  cfg.key, Tenant: cfg.tenant,
			MessageID: func(m Message) string { return m.Header.Get(jetstream.MsgIDHeader) },
		},
		policy: consume.Policy{MaxAttempts: max(cfg.maxAttempts, 1), Base: cfg.base,
			Cap: cfg.cap},
		dlJS: cfg.dlJS, dlSubj: cfg.dlSubj, log: cfg.logger,
	}, nil
}

// pullBuffer is how many messages a Consume asks JetStream for at a time:
// few, so that a message does not wait in the buffer for its AckWait.
const pullBuffer = 16

// Consume handles cons's messages one at a time until ctx ends, then
// returns nil after the message in hand is settled; run it in n goroutines
// to handle n at a time. While a message's Func runs, Consume tells
// JetStream it is in progress every third of the consumer's AckWait. It
// rides out lost connections (nats.go reconnects); it returns an error
// when it cannot start, or when cons's message iterator ends otherwise
// (the consumer was deleted, the connection closed). Messages are pulled
// by the consumer's own settings: give it AckPolicy explicit and
// MaxDeliver -1 (the Handler bounds the deliveries).
func (h *Handler) Consume(ctx context.Context, cons jetstream.Consumer) error {
	ackWait := 30 * time.Second
	if info := cons.CachedInfo(); info != nil && info.Config.AckWait > 0 {
		ackWait = info.Config.AckWait
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(pullBuffer),
		jetstream.WithMessagesErrOnMissingHeartbeat(false))
	if err != nil {
		return fmt.Errorf("natsconsumer: %w", err)
	}
	defer it.Stop()
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		switch {
		case ctx.Err() != nil:
			if msg != nil {
				_ = msg.Nak() // pulled but never handled: redeliver it now
			}
			return nil
		case errors.Is(err, jetstream.ErrMsgIteratorClosed):
			return fmt.Errorf("natsconsumer: %w", err)
		case err != nil:
			h.logf(slog.LevelWarn, "natsconsumer: pulling messages", "err", err)
			continue
		}
		h.handle(ctx, msg, ackWait)
	}
}

// handle decides and settles one message.
func (h *Handler) handle(ctx context.Context, msg jetstream.Msg, ackWait time.Duration) {
	m := message(msg)
	stop := inProgress(msg, ackWait)
	v, c, err := h.decide(ctx, m)
	stop()
	h.settle(ctx, msg, m, v, c, err)
}

// message returns what a Func sees of msg.
func message(msg jetstream.Msg) Message {
	m := Message{Subject: msg.Subject(), Header: msg.Headers(), Data: msg.Data(), Delivered: 1}
	if md, err := msg.Metadata(); err == nil {
		m.Stream, m.Sequence = md.Stream, md.Sequence.Stream
		m.Delivered = int(min(md.NumDelivered, uint64(1<<31-1)))
	}
	return m
}

// inProgress tells JetStream that msg is being worked on every third of
// ackWait until the returned function is called.
func inProgress(msg jetstream.Msg, ackWait time.Duration) (stop func()) {
	t := time.NewTicker(max(ackWait/3, 10*time.Millisecond))
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-t.C:
				_ = msg.InProgress()
			case <-done:
				return
			}
		}
	}()
	return func() {
		t.Stop()
		close(done)
		wg.Wait()
	}
}

// decide runs m through the function door and returns what to do with it,
// the call it made, and Do's error.
func (h *Handler) decide(ctx context.Context, m Message) (consume.Verdict, idempotency.Call,
	error) {
	c, err := h.scope.Call(m, m.Data)
	if err != nil {
		return consume.Outcome(err, false, m.Delivered, h.policy), c, err
	}
	res, err := h.mw.Do(ctx, c, func(ctx context.Context, run *idempotency.Run) ([]byte,
		error) {
		return nil, h.fn(ctx, run, m)
	})
	return consume.Outcome(err, res.Replayed, m.Delivered, h.policy), c, err
}

// ackTimeout bounds every acknowledgement and dead-letter publish.
const ackTimeout = 10 * time.Second

// settle does to msg what v says. It runs even when ctx has ended, each
// step bounded by ackTimeout.
func (h *Handler) settle(ctx context.Context, msg jetstream.Msg, m Message, v consume.Verdict,
	c idempotency.Call, err error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackTimeout)
	defer cancel()
	attrs := []any{"operation", h.scope.Operation, "stream", m.Stream, "seq", m.Sequence,
		"delivered", m.Delivered, "reason", string(v.Reason)}
	if c.Key != "" {
		attrs = append(attrs, "key_digest", keygen.Digest(c.Key))
	}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	switch v.Action {
	case consume.Ack:
		// The double acknowledgement: a lost ack is known, and the
		// redelivery it brings gets the stored outcome.
		if aerr := msg.DoubleAck(ctx); aerr != nil {
			h.logf(slog.LevelWarn, "natsconsumer: the acknowledgement was lost; "+
				"the redelivery will be answered from the store", append(attrs, "ack_err", aerr)...)
			return
		}
		h.logf(slog.LevelDebug, "natsconsumer: acknowledged", attrs...)
	case consume.Redeliver:
		if nerr := msg.NakWithDelay(v.Delay); nerr != nil {
			attrs = append(attrs, "nak_err", nerr)
		}
		h.logf(slog.LevelInfo, "natsconsumer: redelivery", append(attrs, "delay", v.Delay)...)
	case consume.DeadLetter:
		if h.dlJS != nil {
			if perr := h.publishDeadLetter(ctx, m, v.Reason, err); perr != nil {
				delay := h.policy.Backoff(m.Delivered, rand.Float64())
				_ = msg.NakWithDelay(delay)
				h.logf(slog.LevelWarn, "natsconsumer: the dead-letter copy was not published; "+
					"redelivery", append(attrs, "publish_err", perr, "delay", delay)...)
				return
			}
		}
		if terr := msg.Term(); terr != nil {
			attrs = append(attrs, "term_err", terr)
		}
		h.logf(slog.LevelWarn, "natsconsumer: dead-lettered", attrs...)
	}
}

// The headers of a dead-letter copy.
const (
	headerReason   = "Saferetry-Reason"
	headerError    = "Saferetry-Error"
	headerStream   = "Saferetry-Stream"
	headerSequence = "Saferetry-Sequence"
	headerSubject  = "Saferetry-Subject"
	headerMsgID    = "Saferetry-Msg-Id"
	maxErrorHeader = 1024
)

// publishDeadLetter publishes m's copy to the dead-letter subject: its
// data and headers (but the server's Nats-*), the reason and the error,
// under a message id of its own stream sequence, so that publishing it
// again (the Term lost) is dropped within the duplicate window.
func (h *Handler) publishDeadLetter(ctx context.Context, m Message, r consume.Reason,
	err error) error {
	dl := &nats.Msg{Subject: h.dlSubj, Data: m.Data, Header: nats.Header{}}
	for k, vs := range m.Header {
		if !strings.HasPrefix(k, "Nats-") {
			dl.Header[k] = append([]string(nil), vs...)
		}
	}
	if id := m.Header.Get(jetstream.MsgIDHeader); id != "" {
		dl.Header.Set(headerMsgID, id)
	}
	dl.Header.Set(headerReason, string(r))
	if err != nil {
		msg := strings.ToValidUTF8(strings.NewReplacer("\r", " ", "\n", " ").Replace(
			err.Error()), "?")
		if len(msg) > maxErrorHeader {
			msg = strings.ToValidUTF8(msg[:maxErrorHeader], "")
		}
		dl.Header.Set(headerError, msg)
	}
	dl.Header.Set(headerStream, m.Stream)
	dl.Header.Set(headerSequence, strconv.FormatUint(m.Sequence, 10))
	dl.Header.Set(headerSubject, m.Subject)
	dl.Header.Set(jetstream.MsgIDHeader, "dead-letter:"+m.Stream+":"+
		strconv.FormatUint(m.Sequence, 10))
	_, perr := h.dlJS.PublishMsg(ctx, dl)
	return perr
}

func (h *Handler) logf(level slog.Level, msg string, attrs ...any) {
	if h.log != nil {
		h.log.Log(context.Background(), level, msg, attrs...)
	}
}

// ErrNoRun is the error of Publish called without a Run.
var ErrNoRun = errors.New("natsconsumer: Publish needs the Run of a handler")

// Publish publishes msg through js from inside a handler, as the External
// step named step of run (see idempotency.Run.External), with the message
// id (Nats-Msg-Id) run.DownstreamKey(step): the step's intent is recorded
// before the publish and its PubAck after it, so that a redelivery of the
// message resumes after a published step without publishing again, and
// one that finds the outcome unknown (the handler died, or the PubAck was
// lost) publishes again under the same id, which JetStream drops within
// the stream's duplicate window (and a consumer keyed by message id after
// it). As every External step, call it before the handler's first write
// through sqlstore.Tx. msg is not modified: a copy is published. Errors
// are *idempotency.PhaseError (Step "call" wraps js's error: return it, the
// message is redelivered and the step resumed), and ErrNoRun.
func Publish(ctx context.Context, js jetstream.JetStream, run *idempotency.Run, step string,
	msg *nats.Msg) (*jetstream.PubAck, error) {
	switch {
	case run == nil:
		return nil, ErrNoRun
	case msg == nil:
		return nil, errors.New("natsconsumer: Publish of a nil message")
	}
	out, err := run.External(ctx, step, func(ctx context.Context, id string) ([]byte, error) {
		cp := &nats.Msg{Subject: msg.Subject, Reply: msg.Reply, Data: msg.Data,
			Header: nats.Header{}}
		for k, vs := range msg.Header {
			cp.Header[k] = append([]string(nil), vs...)
		}
		cp.Header.Set(jetstream.MsgIDHeader, id)
		ack, err := js.PublishMsg(ctx, cp)
		if err != nil {
			return nil, err
		}
		return json.Marshal(ack)
	}, nil)
	if err != nil {
		return nil, err
	}
	var ack jetstream.PubAck
	if err := json.Unmarshal(out, &ack); err != nil {
		return nil, fmt.Errorf("natsconsumer: the stored PubAck of step %q: %w", step, err)
	}
	return &ack, nil
}
