//! Scratch: transport comparisons, repeated.
fn main() {
    let runs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(7);
    for round in 0..3 {
        let t = std::time::Instant::now();
        for c in dejavu_benches::net::compare_transports(runs) {
            if c.transport == "tcp" {
                print!("{}: {:.2}x  ", c.case.name, c.raw.as_secs_f64() / c.peer.as_secs_f64());
            }
        }
        println!(" (round {round}, {:?})", t.elapsed());
    }
}
