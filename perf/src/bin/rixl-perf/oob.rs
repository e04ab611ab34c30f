//! Out-of-band exchange over TCP (like perftest's port 18515): parameters, the server's region,
//! queue pair endpoints, and the commands that pace a run. Text lines, one message per line.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

use rixl::verbs::Endpoint;

pub struct Oob {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Oob {
    pub fn new(s: TcpStream) -> std::io::Result<Oob> {
        s.set_nodelay(true)?;
        Ok(Oob {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
        })
    }

    pub fn send(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.writer, "{line}").map_err(|e| format!("out-of-band send: {e}"))
    }

    pub fn recv(&mut self) -> Result<String, String> {
        let mut l = String::new();
        match self.reader.read_line(&mut l) {
            Ok(0) => Err("peer closed the out-of-band connection".into()),
            Ok(_) => Ok(l.trim_end().to_string()),
            Err(e) => Err(format!("out-of-band receive: {e}")),
        }
    }

    /// Receives a line that must start with `word`; returns the rest split on spaces.
    pub fn expect(&mut self, word: &str) -> Result<Vec<String>, String> {
        let l = self.recv()?;
        let mut parts = l.split(' ');
        if parts.next() != Some(word) {
            return Err(format!("expected {word}, got {l:?}"));
        }
        Ok(parts.map(String::from).collect())
    }

    pub fn send_endpoint(&mut self, ep: &Endpoint) -> Result<(), String> {
        self.send(&format!("EP {}", hex::encode(ep.to_bytes())))
    }

    pub fn recv_endpoint(&mut self) -> Result<Endpoint, String> {
        let f = self.expect("EP")?;
        let v = f.first().ok_or("EP without value")?;
        let bytes = hex::decode(v).map_err(|e| format!("bad hex {v:?}: {e}"))?;
        Endpoint::from_bytes(&bytes).map_err(|e| e.to_string())
    }
}

/// The parameters the client announces.
#[derive(Debug, Clone)]
pub struct Hello {
    pub test: String,
    pub qps: u32,
    pub engines: u32,
    pub max_size: u64,
    pub tx_depth: u32,
}

impl Hello {
    pub fn line(&self) -> String {
        format!(
            "RIXL-PERF 1 {} {} {} {} {}",
            self.test, self.qps, self.engines, self.max_size, self.tx_depth
        )
    }

    pub fn parse(l: &str) -> Result<Hello, String> {
        let f: Vec<&str> = l.split(' ').collect();
        if f.len() != 7 || f[0] != "RIXL-PERF" {
            return Err(format!("not a rixl-perf client: {l:?}"));
        }
        if f[1] != "1" {
            return Err(format!("protocol version {} is not supported (1)", f[1]));
        }
        let n = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| format!("bad number {s:?} in {l:?}"))
        };
        Ok(Hello {
            test: f[2].to_string(),
            qps: n(f[3])? as u32,
            engines: n(f[4])? as u32,
            max_size: n(f[5])?,
            tx_depth: n(f[6])? as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_rejects_garbage() {
        let h = Hello {
            test: "write_bw".into(),
            qps: 2,
            engines: 1,
            max_size: 65536,
            tx_depth: 128,
        };
        let back = Hello::parse(&h.line()).expect("parse");
        assert_eq!(
            (back.test.as_str(), back.qps, back.max_size),
            ("write_bw", 2, 65536)
        );
        assert!(Hello::parse("GET / HTTP/1.1").is_err());
        assert!(Hello::parse("RIXL-PERF 2 write_bw 1 1 1 1").is_err());
    }

    #[test]
    fn endpoints_cross_as_hex() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let mut a = Oob::new(TcpStream::connect(l.local_addr().expect("addr")).expect("connect"))
            .expect("oob");
        let mut b = Oob::new(l.accept().expect("accept").0).expect("oob");
        let ep = Endpoint {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 7,
            gid: rixl::verbs::Gid([0xfe; 16]),
            mtu: rixl::verbs::Mtu::Mtu1024,
        };
        a.send_endpoint(&ep).expect("send");
        assert_eq!(b.recv_endpoint().expect("recv"), ep);
        a.send(&format!("EP {}", hex::encode(ep.to_bytes()).to_uppercase()))
            .expect("send");
        assert_eq!(b.recv_endpoint().expect("upper-case hex"), ep);
        for bad in ["EP abc", "EP zz", "EP", "EP 00"] {
            a.send(bad).expect("send");
            assert!(b.recv_endpoint().is_err(), "{bad}");
        }
    }
}
