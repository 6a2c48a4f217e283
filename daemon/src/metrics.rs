//! Prometheus metrics of a cluster process: an [`Exposition`] writes samples in the Prometheus text
//! format, and [`serve`] answers `GET /metrics` over HTTP/1.1 from a thread of its own with what a
//! render function returns at that moment. Every counter lives in the process it describes;
//! rendering only reads them.

use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// A metrics page in the Prometheus text exposition format (version 0.0.4).
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
}

/// What a metric is, for its `# TYPE` line.
#[derive(Clone, Copy, Debug)]
pub enum MetricType {
    /// Only ever grows (until the process restarts).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Observations, as a `_sum` and a `_count` sample.
    Summary,
}

impl Exposition {
    /// An empty page.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts metric `name`: its help and type lines. Its samples follow with [`Exposition::sample`].
    pub fn family(&mut self, name: &str, kind: MetricType, help: &str) -> &mut Self {
        let kind = match kind {
            MetricType::Counter => "counter",
            MetricType::Gauge => "gauge",
            MetricType::Summary => "summary",
        };
        let _ = writeln!(self.text, "# HELP {name} {}", escape(help, false));
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
        self
    }

    /// One sample of `name` with `labels`.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (label, value)) in labels.iter().enumerate() {
                let comma = if i == 0 { "" } else { "," };
                let _ = write!(self.text, "{comma}{label}=\"{}\"", escape(value, true));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
        self
    }

    /// A metric with a single unlabelled sample.
    pub fn single(&mut self, name: &str, kind: MetricType, help: &str, value: f64) -> &mut Self {
        self.family(name, kind, help).sample(name, &[], value)
    }

    /// The page.
    pub fn finish(self) -> String {
        self.text
    }
}

/// Escapes a help text or (with `quotes`) a label value as the text format asks.
fn escape(s: &str, quotes: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quotes => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out
}

/// Longest request head read; a scraper's request is a few hundred bytes.
const MAX_REQUEST: usize = 8 << 10;

/// Serves `GET /metrics` at `addr` (port 0 picks one) from a thread of its own, for the life of the
/// process, with the page `render` returns at each request; returns the bound address.
pub fn serve(addr: SocketAddr, render: impl Fn() -> String + Send + 'static) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new().name("metrics".into()).spawn(move || {
        for stream in listener.incoming() {
            match stream {
                // One scraper at a time is plenty; a broken one only costs its own connection.
                Ok(stream) => drop(answer(stream, &render)),
                // Out of descriptors, say: wait rather than spin.
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    })?;
    Ok(bound)
}

/// Reads one request head and answers it, then closes the connection.
fn answer(mut stream: TcpStream, render: &dyn Fn() -> String) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        if head.len() > MAX_REQUEST {
            respond(&mut stream, "431 Request Header Fields Too Large", "text/plain", "too long\n")?;
            // Read what is left (bounded), so closing does not reset the connection before the
            // client has read the answer.
            let _ = std::io::copy(&mut (&mut stream).take(1 << 20), &mut std::io::sink());
            return Ok(());
        }
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    match (parts.next(), parts.next()) {
        (Some(b"GET"), Some(b"/metrics")) => {
            respond(&mut stream, "200 OK", "text/plain; version=0.0.4; charset=utf-8", &render())
        }
        (Some(b"GET"), _) => respond(&mut stream, "404 Not Found", "text/plain", "try /metrics\n"),
        _ => respond(&mut stream, "405 Method Not Allowed", "text/plain", "only GET\n"),
    }
}

fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &str) -> std::io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

/// Fetches the page at `addr` (a scraper's view, for tests and the cluster).
pub fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::new(ErrorKind::InvalidData, "no end of the response head"))?;
    if !head.starts_with("HTTP/1.1 200") {
        let status = head.lines().next().unwrap_or_default().to_owned();
        return Err(std::io::Error::new(ErrorKind::InvalidData, status));
    }
    Ok(body.to_owned())
}

/// The value of the sample of `name` whose labels include every one of `labels`, in a page.
pub fn value_of(page: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    page.lines().filter(|line| !line.starts_with('#')).find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
        let matches = metric == name
            && labels
                .iter()
                .all(|(label, value)| rest.contains(&format!("{label}=\"{}\"", escape(value, true))));
        matches.then(|| value.parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_served_and_read_back() {
        let addr = serve("127.0.0.1:0".parse().unwrap(), || {
            let mut page = Exposition::new();
            page.single("dejavu_test_steps_total", MetricType::Counter, "Steps \"run\".\nNew line.", 42.0);
            page.family("dejavu_test_bytes_total", MetricType::Counter, "Bytes by direction.")
                .sample("dejavu_test_bytes_total", &[("direction", "in")], 7.0)
                .sample("dejavu_test_bytes_total", &[("direction", "out \"x\"")], 1.5);
            page.finish()
        })
        .unwrap();
        let page = scrape(addr).unwrap();
        assert!(page.contains("# TYPE dejavu_test_steps_total counter\n"), "{page}");
        assert!(page.contains("# HELP dejavu_test_steps_total Steps \"run\".\\nNew line.\n"), "{page}");
        assert_eq!(value_of(&page, "dejavu_test_steps_total", &[]), Some(42.0));
        assert_eq!(value_of(&page, "dejavu_test_bytes_total", &[("direction", "in")]), Some(7.0));
        assert_eq!(value_of(&page, "dejavu_test_bytes_total", &[("direction", "out \"x\"")]), Some(1.5));
        assert_eq!(value_of(&page, "dejavu_test_bytes_total", &[("direction", "sideways")]), None);
        assert_eq!(value_of(&page, "dejavu_test_missing", &[]), None);
    }

    #[test]
    fn other_paths_and_methods_are_refused() {
        let addr = serve("127.0.0.1:0".parse().unwrap(), String::new).unwrap();
        let ask = |request: &str| {
            let mut stream = TcpStream::connect(addr).unwrap();
            stream.write_all(request.as_bytes()).unwrap();
            stream.shutdown(std::net::Shutdown::Write).unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).unwrap();
            response
        };
        assert!(ask("GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(ask("POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        let flood = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(MAX_REQUEST * 2));
        assert!(ask(&flood).starts_with("HTTP/1.1 431"));
        // The server survives all of that.
        assert_eq!(scrape(addr).unwrap(), "");
    }
}
