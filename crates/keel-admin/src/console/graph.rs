//! Graphs drawn by the server as inline SVG: they need no script, no
//! outside asset and nothing the console's `Content-Security-Policy`
//! forbids, and the live stream swaps them in with their section.
//!
//! Each graph carries its data for tests and scripts: a sparkline's
//! `data-points` (comma-separated, empty where unknown), `data-last` and
//! `data-peak`; a breaker timeline's bands carry `data-state`.

use std::fmt::Write as _;

use super::html::escape;

/// A graph's size in SVG units (its box scales with the page).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Size {
    pub(crate) width: f64,
    pub(crate) height: f64,
}

/// A sparkline's size: a row's cell.
pub(crate) const SPARK: Size = Size {
    width: 120.0,
    height: 24.0,
};

/// A detail view's graph.
pub(crate) const CHART: Size = Size {
    width: 600.0,
    height: 90.0,
};

/// `value` short: `0`, `12`, `3.4`, `0.012`.
pub(crate) fn short(value: f64) -> String {
    if !value.is_finite() {
        return "—".to_owned();
    }
    let magnitude = value.abs();
    if magnitude == 0.0 || magnitude >= 100.0 {
        format!("{value:.0}")
    } else if magnitude >= 1.0 {
        format!("{value:.1}").trim_end_matches(".0").to_owned()
    } else {
        format!("{value:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_owned()
    }
}

/// The last known value of `values`.
pub(crate) fn last(values: &[f64]) -> f64 {
    values
        .iter()
        .rev()
        .copied()
        .find(|v| v.is_finite())
        .unwrap_or(f64::NAN)
}

fn peak(values: &[f64]) -> f64 {
    values
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f64::NAN, f64::max)
}

/// A line of `values` (oldest first, `NaN` a gap), scaled from 0 to its
/// peak, named `series` for tests and labelled `label` for people.
pub(crate) fn sparkline(values: &[f64], series: &str, label: &str, size: Size) -> String {
    let (last, peak) = (last(values), peak(values));
    let top = if peak.is_finite() && peak > 0.0 {
        peak
    } else {
        1.0
    };
    let step = size.width / (values.len().max(2) - 1) as f64;
    let mut path = String::new();
    let mut pen_down = false;
    for (i, v) in values.iter().enumerate() {
        if !v.is_finite() {
            pen_down = false;
            continue;
        }
        let x = i as f64 * step;
        let y = size.height - 1.0 - (v / top) * (size.height - 2.0);
        // A run's first point gets a sliver of line, which the round cap
        // draws as a dot: a lone point between gaps stays visible.
        if pen_down {
            let _ = write!(path, "L{x:.1} {y:.1}");
        } else {
            let _ = write!(path, "M{x:.1} {y:.1}h0.1");
        }
        pen_down = true;
    }
    let points: Vec<String> = values
        .iter()
        .map(|v| {
            if v.is_finite() {
                short(*v)
            } else {
                String::new()
            }
        })
        .collect();
    format!(
        "<svg class=\"spark\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\" \
         data-series=\"{series}\" data-last=\"{last_s}\" data-peak=\"{peak_s}\" data-points=\"{points}\">\
         <title>{label}: now {last_s}, peak {peak_s}</title><path d=\"{path}\"/></svg>",
        w = size.width,
        h = size.height,
        series = escape(series),
        label = escape(label),
        last_s = short(last),
        peak_s = short(peak),
        points = points.join(","),
    )
}

/// The state a breaker level (0 closed, 1 half-open, 2 open) is drawn as.
fn state_of(level: f64) -> &'static str {
    match level {
        l if !l.is_finite() => "unknown",
        l if l >= 2.0 => "open",
        l if l >= 1.0 => "half_open",
        _ => "closed",
    }
}

/// A breaker's state over time as bands, one per run of one state, with
/// the number of transitions.
pub(crate) fn timeline(levels: &[f64], transitions: u64, size: Size) -> String {
    let step = size.width / levels.len().max(1) as f64;
    let mut bands = String::new();
    let mut start = 0;
    for i in 1..=levels.len() {
        let run_ends = i == levels.len() || state_of(levels[i]) != state_of(levels[start]);
        if run_ends {
            let state = state_of(levels[start]);
            let _ = write!(
                bands,
                "<rect class=\"band {state}\" data-state=\"{state}\" x=\"{x:.1}\" y=\"0\" \
                 width=\"{w:.1}\" height=\"{h}\"><title>{state}</title></rect>",
                x = start as f64 * step,
                w = (i - start) as f64 * step,
                h = size.height,
            );
            start = i;
        }
    }
    format!(
        "<svg class=\"timeline\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\" \
         data-transitions=\"{transitions}\"><title>breaker state, {transitions} transitions</title>{bands}</svg>",
        w = size.width,
        h = size.height,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparkline_breaks_at_gaps_and_carries_its_data() {
        let svg = sparkline(&[0.0, 4.0, f64::NAN, 2.0], "lag", "lag", SPARK);
        assert!(svg.contains("data-points=\"0,4,,2\""), "{svg}");
        assert!(svg.contains("data-last=\"2\""));
        assert!(svg.contains("data-peak=\"4\""));
        assert_eq!(svg.matches('M').count(), 2, "two runs: {svg}");
    }

    #[test]
    fn an_empty_or_flat_sparkline_draws_without_dividing_by_zero() {
        for values in [&[][..], &[0.0, 0.0], &[f64::NAN]] {
            let svg = sparkline(values, "x", "x", SPARK);
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        }
    }

    #[test]
    fn a_timeline_draws_one_band_per_run() {
        let svg = timeline(&[0.0, 0.0, 2.0, 2.0, 1.0, 0.0], 3, SPARK);
        let states: Vec<&str> = svg
            .split("data-state=\"")
            .skip(1)
            .map(|s| s.split('"').next().unwrap())
            .collect();
        assert_eq!(states, ["closed", "open", "half_open", "closed"]);
        assert!(svg.contains("data-transitions=\"3\""));
    }

    #[test]
    fn hostile_names_are_escaped() {
        let svg = sparkline(&[1.0], "<x>", "\"y\"", SPARK);
        assert!(!svg.contains("<x>") && svg.contains("&lt;x&gt;"));
    }

    #[test]
    fn short_numbers_stay_short() {
        assert_eq!(short(0.0), "0");
        assert_eq!(short(1234.5), "1234");
        assert_eq!(short(3.0), "3");
        assert_eq!(short(3.25), "3.2");
        assert_eq!(short(0.0125), "0.013");
        assert_eq!(short(f64::NAN), "—");
    }
}
