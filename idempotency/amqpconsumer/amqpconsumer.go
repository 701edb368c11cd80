package amqpconsumer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/internal/consume"
	"github.com/saferetry/saferetry/keygen"
)

// Func handles one delivery through the function door, with the Run of its
// execution (Phase, External, Unit, DownstreamKey). Its writes through
// sqlstore.Tx(ctx) commit with the stored outcome. d has no Acknowledger:
// the Handler acknowledges. An error wrapping idempotency.ErrDefinitive is
// stored and dead-letters the message; any other error has it redelivered
// (see the package doc).
type Func func(ctx context.Context, run *idempotency.Run, d amqp.Delivery) error

// Handler consumes a queue's deliveries through the function door. It is
// safe for concurrent use; its Consume may run in several goroutines at
// once.
type Handler struct {
	mw     *idempotency.Middleware
	fn     Func
	scope  consume.Scope[delivery]
	policy consume.Policy
	log    *slog.Logger
}

// delivery is a delivery and the queue it came from.
type delivery struct {
	d     amqp.Delivery
	queue string
}

// Option configures New.
type Option func(*config)

type config struct {
	principal   string
	key, tenant func(amqp.Delivery) (string, error)
	maxAttempts int
	base, cap   time.Duration
	logger      *slog.Logger
}

// WithPrincipal sets the principal of every message's scope. Default: the
// name of the queue Consume consumes, so that two queues never share a
// record.
func WithPrincipal(p string) Option { return func(c *config) { c.principal = p } }

// WithKey sets the function that returns a delivery's idempotency key, in
// place of its message-id property: an event-derived key such as
// keygen.Event("order-charge", orderID), so that the same business event
// published again under a new message id is the same call. An error of
// key, or a key that keygen.Validate refuses, dead-letters the message
// (reason key_invalid). key must be safe for concurrent use; nil keeps the
// default.
func WithKey(key func(amqp.Delivery) (string, error)) Option {
	return func(c *config) { c.key = key }
}

// WithTenant sets the function that returns the tenant a delivery belongs
// to (from a header, say): the principal becomes the principal, "/" and
// the tenant, so that two tenants never share a record. A tenant is 1 to
// 255 bytes of valid UTF-8 without "/"; an error or another value
// dead-letters the message (reason tenant_missing). Default: no tenant.
func WithTenant(tenant func(amqp.Delivery) (string, error)) Option {
	return func(c *config) { c.tenant = tenant }
}

// WithMaxAttempts sets how many times the Func may fail on a message
// before it is dead-lettered (reason attempts_exhausted), counted in the
// header x-saferetry-attempt of the copies that come back. A delivery lost
// with its consumer (a crash, a closed connection) is no attempt: bound
// those with a quorum queue's delivery limit (x-delivery-limit), which
// dead-letters the message itself. Default 5; values under 1 mean 1.
func WithMaxAttempts(n int) Option { return func(c *config) { c.maxAttempts = n } }

// WithBackoff sets the full-jitter backoff (package jitter) between the
// deliveries of a failing message: the delay before delivery n+1 is
// uniform in [0, min(cap, base*2^(n-1))). Default 1 s and 30 s; a
// negative base means 0, a cap of 0 or less means no cap.
func WithBackoff(base, cap time.Duration) Option {
	return func(c *config) { c.base, c.cap = base, cap }
}

// WithLogger sets the logger (default slog.Default()); nil means no
// logging. Records name a message by its queue, delivery tag and key
// digest, never its raw key.
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// ErrInvalidConfig is the error of New for an invalid operation or a nil
// Middleware or Func, and of Consume for an empty queue name.
var ErrInvalidConfig = errors.New("amqpconsumer: invalid configuration")

// New returns a Handler that runs fn for each delivery through mw.Do, with
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
	switch err := consume.CheckOperation(operation); {
	case mw == nil:
		return nil, fmt.Errorf("%w: nil Middleware", ErrInvalidConfig)
	case fn == nil:
		return nil, fmt.Errorf("%w: nil Func", ErrInvalidConfig)
	case err != nil:
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	s := consume.Scope[delivery]{
		Operation: operation, Principal: cfg.principal,
		Base:      func(m delivery) string { return m.queue },
		MessageID: func(m delivery) string { return m.d.MessageId },
	}
	if cfg.key != nil {
		s.Key = func(m delivery) (string, error) { return cfg.key(m.d) }
	}
	if cfg.tenant != nil {
		s.Tenant = func(m delivery) (string, error) { return cfg.tenant(m.d) }
	}
	return &Handler{mw: mw, fn: fn, scope: s,
		policy: consume.Policy{MaxAttempts: max(cfg.maxAttempts, 1), Base: cfg.base,
			Cap: cfg.cap},
		log: cfg.logger}, nil
}

// DelayQueue returns the name of the queue through which Consume
// redelivers queue's messages after a delay: queue + ".delay".
func DelayQueue(queue string) string { return queue + ".delay" }

// attemptHeader counts the deliveries of a message that failed, across the
// Handler's redeliveries.
const attemptHeader = "x-saferetry-attempt"

// Consume handles queue's deliveries on ch one at a time until ctx ends,
// then cancels its consumer, returns the deliveries it had not handled to
// the queue and returns nil; run it in n goroutines to handle n at a
// time, and bound what each holds with ch.Qos. It puts ch in confirm mode
// and declares DelayQueue(queue) (durable, dead-lettering its expired
// messages back to queue), through which a message comes back after a
// delay. queue must exist, with a dead-letter exchange
// (x-dead-letter-exchange) for the messages Consume rejects. Consume
// returns an error when it cannot start, and when ch or its connection
// closes: the broker then requeues the unacknowledged deliveries, and a
// Consume on a new channel answers them from the store.
func (h *Handler) Consume(ctx context.Context, ch *amqp.Channel, queue string) error {
	if queue == "" {
		return fmt.Errorf("%w: an empty queue name", ErrInvalidConfig)
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("amqpconsumer: confirm mode: %w", err)
	}
	if _, err := ch.QueueDeclare(DelayQueue(queue), true, false, false, false, amqp.Table{
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": queue,
	}); err != nil {
		return fmt.Errorf("amqpconsumer: declaring %s: %w", DelayQueue(queue), err)
	}
	tag := consumerTag()
	deliveries, err := ch.Consume(queue, tag, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("amqpconsumer: consuming %s: %w", queue, err)
	}
	for {
		select {
		case <-ctx.Done():
			_ = ch.Cancel(tag, false)
			for d := range deliveries { // prefetched, never handled
				_ = d.Nack(false, true)
			}
			return nil
		case d, ok := <-deliveries:
			if !ok {
				select {
				case cerr := <-closed:
					if cerr != nil {
						return fmt.Errorf("amqpconsumer: the channel closed: %w", cerr)
					}
				default:
				}
				return fmt.Errorf("amqpconsumer: the deliveries ended: %w", amqp.ErrClosed)
			}
			h.handle(ctx, ch, delivery{d: d, queue: queue})
		}
	}
}

func consumerTag() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return "saferetry-" + hex.EncodeToString(b)
}

// handle decides and settles one delivery.
func (h *Handler) handle(ctx context.Context, ch *amqp.Channel, m delivery) {
	attempt := failures(m.d) + 1
	v, c, err := h.decide(ctx, m, attempt)
	h.settle(ctx, ch, m, v, c, err, attempt)
}

// failures returns how many times the Func failed on the message before,
// as its header counts them.
func failures(d amqp.Delivery) int {
	return headerInt(d.Headers[attemptHeader])
}

// headerInt returns a header's value as a count from 0 to 1<<20.
func headerInt(v any) int {
	var n int64
	switch x := v.(type) {
	case int8:
		n = int64(x)
	case int16:
		n = int64(x)
	case int32:
		n = int64(x)
	case int64:
		n = x
	case int:
		n = int64(x)
	case uint8:
		n = int64(x)
	case uint16:
		n = int64(x)
	case uint32:
		n = int64(x)
	case string:
		n, _ = strconv.ParseInt(x, 10, 64)
	}
	return int(min(max(n, 0), 1<<20))
}

// decide runs m through the function door and returns what to do with it,
// the call it made, and Do's error.
func (h *Handler) decide(ctx context.Context, m delivery, attempt int) (consume.Verdict,
	idempotency.Call, error) {
	c, err := h.scope.Call(m, m.d.Body)
	if err != nil {
		return consume.Outcome(err, false, attempt, h.policy), c, err
	}
	d := m.d
	d.Acknowledger = nil // the Func cannot settle the delivery
	res, err := h.mw.Do(ctx, c, func(ctx context.Context, run *idempotency.Run) ([]byte,
		error) {
		return nil, h.fn(ctx, run, d)
	})
	return consume.Outcome(err, res.Replayed, attempt, h.policy), c, err
}

// settleTimeout bounds the settling of one delivery: the confirmation of a
// redelivery's publish and, when that fails, the hold before the requeue.
const settleTimeout = 10 * time.Second

// settle does to m what v says. It runs even when ctx has ended, bounded
// by settleTimeout.
func (h *Handler) settle(ctx context.Context, ch *amqp.Channel, m delivery, v consume.Verdict,
	c idempotency.Call, err error, attempt int) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	attrs := []any{"operation", h.scope.Operation, "queue", m.queue, "delivery_tag",
		m.d.DeliveryTag, "attempt", attempt, "reason", string(v.Reason)}
	if c.Key != "" {
		attrs = append(attrs, "key_digest", keygen.Digest(c.Key))
	}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	switch v.Action {
	case consume.Ack:
		if aerr := m.d.Ack(false); aerr != nil {
			h.logf(slog.LevelWarn, "amqpconsumer: the acknowledgement was lost; "+
				"the redelivery will be answered from the store", append(attrs, "ack_err", aerr)...)
			return
		}
		h.logf(slog.LevelDebug, "amqpconsumer: acknowledged", attrs...)
	case consume.Redeliver:
		// A failure counts (and a store outage, so that its backoff grows);
		// waiting on another execution does not.
		counted := attempt
		if v.Reason == consume.InProgress {
			counted--
		}
		if perr := h.later(ctx, ch, m, v.Delay, counted); perr != nil {
			// The copy may not exist: hold the delivery for the delay (at
			// most what is left of settleTimeout), then have the broker
			// requeue it, so that no requeue loop runs faster than that.
			h.logf(slog.LevelWarn, "amqpconsumer: the delayed copy was not published; "+
				"requeue after the delay", append(attrs, "publish_err", perr, "delay", v.Delay)...)
			t := time.NewTimer(v.Delay)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
			}
			_ = m.d.Nack(false, true)
			return
		}
		if aerr := m.d.Ack(false); aerr != nil {
			attrs = append(attrs, "ack_err", aerr)
		}
		h.logf(slog.LevelInfo, "amqpconsumer: redelivery", append(attrs, "delay", v.Delay)...)
	case consume.DeadLetter:
		if rerr := m.d.Reject(false); rerr != nil {
			attrs = append(attrs, "reject_err", rerr)
		}
		h.logf(slog.LevelWarn, "amqpconsumer: dead-lettered", attrs...)
	}
}

// later publishes a copy of m to the delay queue, to expire back into its
// queue after delay, and waits for the broker's confirmation: only then
// may m be acknowledged.
func (h *Handler) later(ctx context.Context, ch *amqp.Channel, m delivery, delay time.Duration,
	counted int) error {
	d := m.d
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	delete(headers, "x-delivery-count") // the broker's count of this copy's deliveries
	headers[attemptHeader] = int32(min(counted, 1<<20))
	p := amqp.Publishing{
		Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp.Persistent, Priority: d.Priority, CorrelationId: d.CorrelationId,
		ReplyTo: d.ReplyTo, MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type,
		UserId: d.UserId, AppId: d.AppId, Body: d.Body,
		Expiration: strconv.FormatInt(max(delay.Milliseconds(), 0), 10),
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", DelayQueue(m.queue), false,
		false, p)
	if err != nil {
		return err
	}
	return confirmed(ctx, dc)
}

// ErrNotConfirmed is the error of a publish the broker refused (a
// negative confirmation).
var ErrNotConfirmed = errors.New("amqpconsumer: the broker did not confirm the publish")

// confirmed waits for dc (nil on a channel not in confirm mode).
func confirmed(ctx context.Context, dc *amqp.DeferredConfirmation) error {
	if dc == nil {
		return nil
	}
	ok, err := dc.WaitContext(ctx)
	switch {
	case err != nil:
		return err
	case !ok:
		return ErrNotConfirmed
	}
	return nil
}

func (h *Handler) logf(level slog.Level, msg string, attrs ...any) {
	if h.log != nil {
		h.log.Log(context.Background(), level, msg, attrs...)
	}
}

// ErrNoRun is the error of Publish called without a Run.
var ErrNoRun = errors.New("amqpconsumer: Publish needs the Run of a handler")

// Publish publishes msg to exchange with routing key from inside a
// handler, as the External step named step of run (see
// idempotency.Run.External), with the message id run.DownstreamKey(step):
// the step's intent is recorded before the publish and its confirmation
// after it, so that a redelivery resumes after a published step without
// publishing again, and one that finds the outcome unknown (the handler
// died, or the confirmation was lost) publishes again under the same id,
// which a consumer keyed by message id (a Handler without WithKey) drops.
// As every External step, call it before the handler's first write through
// sqlstore.Tx. On a channel in confirm mode (ch.Confirm) it waits for the
// broker's confirmation, bounded by ctx. msg is the caller's: the id is
// set on a copy. Errors are *idempotency.PhaseError (Step "call" wraps
// ch's error or ErrNotConfirmed: return it, the message comes back and
// the step is resumed), and ErrNoRun.
func Publish(ctx context.Context, ch *amqp.Channel, run *idempotency.Run, step, exchange,
	key string, msg amqp.Publishing) error {
	if run == nil {
		return ErrNoRun
	}
	_, err := run.External(ctx, step, func(ctx context.Context, id string) ([]byte, error) {
		msg.MessageId = id
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, false, false,
			msg)
		if err != nil {
			return nil, err
		}
		return nil, confirmed(ctx, dc)
	}, nil)
	return err
}
