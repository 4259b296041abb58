//! `KT_MOE_PHASE_TIMING=1` (the original's variable): each layer reports to stderr, every
//! `KT_MOE_PHASE_TIMING_INTERVAL` forward calls (default 100), the mean wall time per call of
//! each forward phase. Off (the default) a forward pays one cached check.
//!
//! The phases are timed on the thread that drives the first part's team, between the team's
//! barriers, so each figure is the phase's wall time including its slowest thread.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The phases of one forward call, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Sorting the chunk's (token, expert) pairs by expert.
    Route,
    /// x rows to f32 and the format's prepared copy.
    GatherX,
    /// Gate and up panels, SwiGLU.
    GateUp,
    /// The SwiGLU rows prepared for down (formats that prepare them whole).
    SwigluRows,
    /// Down panels and the weighted sum over experts.
    Down,
    /// Residual and output rows (one part).
    Finish,
    /// The parts' partial rows summed (several parts).
    Merge,
}

/// Every phase with its name in the report.
const PHASES: [(Phase, &str); 7] = [
    (Phase::Route, "route"),
    (Phase::GatherX, "gather x"),
    (Phase::GateUp, "gate/up+SwiGLU"),
    (Phase::SwigluRows, "SwiGLU rows"),
    (Phase::Down, "down"),
    (Phase::Finish, "finish"),
    (Phase::Merge, "merge"),
];

/// Calls between reports when the interval variable is unset or not a positive integer.
const DEFAULT_INTERVAL: usize = 100;

/// The reporting interval, read once per process; `None` when timing is off.
pub(crate) fn interval() -> Option<usize> {
    static INTERVAL: OnceLock<Option<usize>> = OnceLock::new();
    *INTERVAL.get_or_init(|| {
        parse(
            std::env::var("KT_MOE_PHASE_TIMING").ok().as_deref(),
            std::env::var("KT_MOE_PHASE_TIMING_INTERVAL")
                .ok()
                .as_deref(),
        )
    })
}

/// The interval the two variables' values give: on for `1`, `true`, `on` or `yes` (any case).
fn parse(on: Option<&str>, every: Option<&str>) -> Option<usize> {
    let on = on.map(|v| v.trim().to_ascii_lowercase());
    if !matches!(on.as_deref(), Some("1" | "true" | "on" | "yes")) {
        return None;
    }
    let every = every.and_then(|v| v.trim().parse::<usize>().ok());
    Some(every.filter(|&n| n > 0).unwrap_or(DEFAULT_INTERVAL))
}

/// One call's phase times, added to from whichever thread runs a phase.
#[derive(Default)]
pub(crate) struct CallTimes {
    nanos: [AtomicU64; PHASES.len()],
}

impl CallTimes {
    /// Add `d` to `phase`.
    pub(crate) fn add(&self, phase: Phase, d: Duration) {
        let d = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.nanos[phase as usize].fetch_add(d, Ordering::Relaxed);
    }

    /// A lap clock starting now.
    pub(crate) fn lap(&self) -> Lap<'_> {
        Lap {
            times: self,
            last: Instant::now(),
        }
    }
}

/// Times consecutive phases: each [`Lap::mark`] charges the time since the previous one.
pub(crate) struct Lap<'a> {
    times: &'a CallTimes,
    last: Instant,
}

impl Lap<'_> {
    /// Charge the time since the last mark to `phase`.
    pub(crate) fn mark(&mut self, phase: Phase) {
        let now = Instant::now();
        self.times.add(phase, now - self.last);
        self.last = now;
    }
}

/// Charge the time since the last mark to `phase`, when there is a clock.
pub(crate) fn mark(lap: &mut Option<Lap<'_>>, phase: Phase) {
    if let Some(lap) = lap {
        lap.mark(phase);
    }
}

/// A layer's sums since its last report.
#[derive(Default)]
pub(crate) struct PhaseStats {
    sums: Mutex<Sums>,
}

#[derive(Default)]
struct Sums {
    calls: usize,
    tokens: usize,
    nanos: [u64; PHASES.len()],
    total: u64,
}

impl PhaseStats {
    /// Add one call of `tokens` tokens that took `total` in all; every `every` calls, the
    /// report line for layer `layer` (and the sums start again).
    pub(crate) fn record(
        &self,
        layer: usize,
        tokens: usize,
        times: &CallTimes,
        total: Duration,
        every: usize,
    ) -> Option<String> {
        let mut s = self.sums.lock().unwrap_or_else(|e| e.into_inner());
        s.calls += 1;
        s.tokens += tokens;
        for (sum, t) in s.nanos.iter_mut().zip(&times.nanos) {
            *sum = sum.saturating_add(t.load(Ordering::Relaxed));
        }
        s.total = s
            .total
            .saturating_add(u64::try_from(total.as_nanos()).unwrap_or(u64::MAX));
        if s.calls < every {
            return None;
        }
        let line = report(layer, &s);
        *s = Sums::default();
        Some(line)
    }
}

/// The report of `s`: means per call in ms, then what the phases leave of the call.
fn report(layer: usize, s: &Sums) -> String {
    let calls = s.calls.max(1) as f64;
    let ms = |nanos: u64| nanos as f64 / calls / 1e6;
    let phases: Vec<String> = PHASES
        .iter()
        .map(|&(p, name)| format!("{name} {:.3}", ms(s.nanos[p as usize])))
        .collect();
    let timed: u64 = s.nanos.iter().sum();
    format!(
        "kt_kernel phase timing: layer {layer}, {} calls, {:.1} tokens per call, mean ms per \
         call: {}, other {:.3}, total {:.3}",
        s.calls,
        s.tokens as f64 / calls,
        phases.join(", "),
        ms(s.total.saturating_sub(timed)),
        ms(s.total)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variables_turn_timing_on_and_set_the_interval() {
        assert_eq!(parse(None, Some("5")), None);
        assert_eq!(parse(Some("0"), None), None);
        assert_eq!(parse(Some("false"), Some("5")), None);
        assert_eq!(parse(Some("1"), None), Some(DEFAULT_INTERVAL));
        assert_eq!(parse(Some(" TRUE "), Some("7")), Some(7));
        assert_eq!(parse(Some("on"), Some("0")), Some(DEFAULT_INTERVAL));
        assert_eq!(parse(Some("yes"), Some("-3")), Some(DEFAULT_INTERVAL));
        assert_eq!(parse(Some("1"), Some("many")), Some(DEFAULT_INTERVAL));
    }

    #[test]
    fn a_report_every_interval_gives_the_means_and_starts_again() {
        let stats = PhaseStats::default();
        let ms = Duration::from_millis;
        for call in 1..=6 {
            let times = CallTimes::default();
            times.add(Phase::GateUp, ms(4));
            times.add(Phase::Down, ms(2 * call));
            let mut lap = Some(times.lap());
            mark(&mut lap, Phase::Finish);
            let line = stats.record(3, 10 * call as usize, &times, ms(20), 3);
            match call {
                3 => {
                    // Calls 1-3: down 2, 4, 6 ms, 20 tokens per call on average.
                    assert!(line.as_deref().unwrap().starts_with(
                        "kt_kernel phase timing: layer 3, 3 calls, 20.0 tokens per call, mean ms \
                         per call: route 0.000, gather x 0.000, gate/up+SwiGLU 4.000, SwiGLU \
                         rows 0.000, down 4.000, finish "
                    ));
                    assert!(line.as_deref().unwrap().ends_with("total 20.000"));
                }
                6 => {
                    let line = line.unwrap();
                    assert!(line.contains("3 calls, 50.0 tokens per call"), "{line}");
                    assert!(line.contains(", down 10.000,"), "{line}");
                }
                _ => assert_eq!(line, None),
            }
        }
    }

    #[test]
    fn the_remainder_of_the_call_is_reported_as_other() {
        let stats = PhaseStats::default();
        let times = CallTimes::default();
        times.add(Phase::Route, Duration::from_micros(500));
        times.add(Phase::Merge, Duration::from_micros(1500));
        let line = stats
            .record(0, 1, &times, Duration::from_millis(5), 1)
            .unwrap();
        assert!(line.contains("route 0.500,"), "{line}");
        assert!(
            line.contains("merge 1.500, other 3.000, total 5.000"),
            "{line}"
        );
    }
}
