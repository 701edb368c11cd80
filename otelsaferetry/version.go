package otelsaferetry

// ScopeName is the instrumentation scope of the meters and tracers this
// package creates: its import path.
const ScopeName = "github.com/saferetry/saferetry/otelsaferetry"

// version is this instrumentation's version, reported as its scope's.
const version = "0.1.0"
