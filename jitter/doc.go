// Package jitter holds the backoff formulas used between retries.
//
// Every formula is a pure function of the retry number, the previous wait,
// the base, the cap and one random value r in [0, 1) supplied by the caller,
// so results are reproducible in tests and simulations and the package keeps
// no state and needs no locking. The formulas follow Marc Brooker,
// "Exponential Backoff And Jitter" (AWS Architecture Blog, 2015):
//
//   - [Full] (the default): sleep = r * min(cap, base * 2^attempt).
//     Brooker's simulations show it does the least total work of the
//     jittered variants, and it is what the saferetry Transport uses.
//   - [Decorrelated]: sleep = min(cap, base + r * (3*prev - base)).
//   - [Equal]: half of the exponential value plus a random half.
//   - [None]: plain capped exponential growth without jitter. It synchronises
//     clients into waves and exists only for comparison and simulation.
//
// All formulas saturate instead of overflowing: a huge attempt number or
// a huge previous wait yields the cap, never a negative or wrapped duration.
//
// [Config] applies saferetry's defaults (base 50 ms for transient failures,
// 1 s for throttling, cap 20 s) and [NewBackOff] adapts any formula to the
// github.com/cenkalti/backoff/v4 BackOff interface.
package jitter
