//! Time as Tidemark prints it: unix microseconds (the `sent_at_us` of every entry and log
//! record) as an RFC 3339 UTC timestamp with microseconds, the one formatter behind
//! `tidemark tail` and `tidemark trace`. No clock and no time zone database: pure arithmetic.

/// Unix microseconds as `YYYY-MM-DDTHH:MM:SS.ffffffZ` (UTC, proleptic Gregorian).
pub fn format_unix_us(us: u64) -> String {
    const US_PER_DAY: u64 = 86_400_000_000;
    let days = us / US_PER_DAY;
    let in_day = us % US_PER_DAY;
    let (y, m, d) = civil_from_days(days);
    let secs = in_day / 1_000_000;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        in_day % 1_000_000
    )
}

/// Year, month (1..=12), day (1..=31) of the day `days` after 1970-01-01. Howard Hinnant's
/// `civil_from_days`, for non-negative day counts only.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    // Shift the epoch to 0000-03-01 so leap days fall at the end of a year.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097; // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // 0..=365, from March 1
    let mp = (5 * doy + 2) / 153; // 0..=11, March = 0
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_time() {
        assert_eq!(
            format_unix_us(1_764_489_600_000_000),
            "2025-11-30T08:00:00.000000Z"
        );
    }

    #[test]
    fn time_formatting_edges() {
        let day = 86_400_000_000u64;
        for (us, want) in [
            (0, "1970-01-01T00:00:00.000000Z"),
            (day - 1, "1970-01-01T23:59:59.999999Z"),
            (951_782_400_000_000, "2000-02-29T00:00:00.000000Z"), // leap day, /400 year
            (951_868_800_000_000, "2000-03-01T00:00:00.000000Z"),
            (4_107_456_000_000_000, "2100-02-28T00:00:00.000000Z"), // 2100 is not leap
            (4_107_542_400_000_000, "2100-03-01T00:00:00.000000Z"),
            (1_709_251_199_000_000, "2024-02-29T23:59:59.000000Z"),
            (1_735_689_599_999_999, "2024-12-31T23:59:59.999999Z"),
            (1_735_689_600_000_000, "2025-01-01T00:00:00.000000Z"),
            (253_402_300_799_000_000, "9999-12-31T23:59:59.000000Z"),
        ] {
            assert_eq!(format_unix_us(us), want, "{us}");
        }
        // Never panics, even far beyond year 9999.
        assert!(format_unix_us(u64::MAX).ends_with('Z'));
    }

    #[test]
    fn civil_from_days_matches_a_day_by_day_walk() {
        let (mut y, mut m, mut d) = (1970u64, 1u64, 1u64);
        for days in 0..200_000u64 {
            assert_eq!(civil_from_days(days), (y, m, d), "day {days}");
            let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
            let len = match m {
                2 if leap => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            d += 1;
            if d > len {
                d = 1;
                m += 1;
                if m > 12 {
                    m = 1;
                    y += 1;
                }
            }
        }
    }
}
