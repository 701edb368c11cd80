package otelsaferetry

// ScopeName is the instrumentation scope of the meters and tracers this
// package creates: its import path.
const ScopeName = "github.com/saferetry/saferetry/otelsaferetry"

// Version returns the version of this instrumentation, reported as the
// instrumentation scope's version.
func Version() string {
	return "0.1.0"
}
