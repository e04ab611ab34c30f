//! perftest-compatible command line: the same flags, meanings and defaults.

use std::time::Duration;

use rixl::runtime::PollMode;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    WriteBw,
    ReadBw,
    SendBw,
    WriteLat,
    ReadLat,
    SendLat,
}

impl Test {
    pub fn parse(s: &str) -> Option<Test> {
        Some(match s {
            "write_bw" => Test::WriteBw,
            "read_bw" => Test::ReadBw,
            "send_bw" => Test::SendBw,
            "write_lat" => Test::WriteLat,
            "read_lat" => Test::ReadLat,
            "send_lat" => Test::SendLat,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write_bw",
            Test::ReadBw => "read_bw",
            Test::SendBw => "send_bw",
            Test::WriteLat => "write_lat",
            Test::ReadLat => "read_lat",
            Test::SendLat => "send_lat",
        }
    }

    pub fn is_bw(self) -> bool {
        matches!(self, Test::WriteBw | Test::ReadBw | Test::SendBw)
    }

    pub fn is_send(self) -> bool {
        matches!(self, Test::SendBw | Test::SendLat)
    }
}

/// How the write_lat ping-pong learns that the peer's WRITE has landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notify {
    /// Spin on the last byte of the landing area (`rixl::runtime::wait_flag`), as perftest does.
    Flag,
    /// WRITE_WITH_IMM: a receive completion at the target (`Engine::recv`).
    Imm,
}

impl Notify {
    pub fn name(self) -> &'static str {
        match self {
            Notify::Flag => "flag",
            Notify::Imm => "imm",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Args {
    pub test: Test,
    pub server: Option<String>,
    pub device: Option<String>,
    pub ib_port: u8,
    pub gid_index: Option<u32>,
    pub sizes: Vec<u64>,
    pub iters: u64,
    pub qps: u32,
    pub tx_depth: u32,
    pub post_list: u32,
    pub duration: Option<Duration>,
    pub port: u16,
    pub report_gbits: bool,
    pub out_json: Option<String>,
    pub poll_mode: PollMode,
    /// Coalesce small transfers' doorbells and signals (`--coalesce`; off by default).
    pub coalesce: bool,
    /// Prepare each transfer once and re-post it (`--prepared`: `Engine::prepare` + `post`).
    pub prepared: bool,
    /// How write_lat detects arrival: a flag byte in memory (perftest's way) or WRITE_WITH_IMM.
    pub notify: Notify,
    pub engines: u32,
    pub cpu: Option<usize>,
}

pub const USAGE: &str = "\
usage: rixl-perf TEST [options] [server-host]
  TEST: write_bw read_bw send_bw write_lat read_lat send_lat   (or: rixl-perf sweep --help)
  perftest options (same meaning and defaults as ib_write_bw & co.):
    -d, --ib-dev <dev>        RDMA device (default: first, or $RIXL_RDMA_DEVICE)
    -i, --ib-port <port>      port (default 1)
    -x, --gid-index <idx>     GID index (default $RIXL_GID_INDEX or 1)
    -s, --size <bytes>        message size (default 65536 for bw, 2 for lat)
    -a, --all                 all sizes 2 B .. 8 MiB
    -n, --iters <n>           iterations (default 5000 write_bw, 1000 otherwise)
    -q, --qp <n>              queue pairs (default 1)
    -t, --tx-depth <n>        outstanding requests (default 128 bw, 1 lat)
    -l, --post_list <n>       descriptors per transfer (one doorbell; default 1)
    -D, --duration <s>        run for s seconds instead of -n iterations
    -F, --CPU-freq            accepted (no CPU frequency warning is printed anyway)
    -p, --port <port>         TCP port of the out-of-band exchange (default 18515)
        --report_gbits        report bandwidth in Gb/sec
        --out_json            write the report as JSON (perftest_out.json)
        --out_json_file <f>   ... to this file
  rixl options:
        --poll-mode busy|event   engine completion mode (default busy)
        --coalesce               share doorbells and signaled completions among small transfers
        --prepared               check and plan each transfer once, then re-post it (like
                                 NIXL's prepared transfer requests; READ/WRITE tests)
        --notify flag|imm        write_lat arrival: a flag byte in memory, as perftest (default),
                                 or WRITE_WITH_IMM and a receive completion
        --engines <n>            engines (cores) on the client for bw tests (default 1)
        --cpu <n>                first CPU to pin engines to (default: client 0, server the last)";

fn value<'a>(it: &mut impl Iterator<Item = &'a String>, flag: &str) -> Result<&'a String, String> {
    it.next().ok_or_else(|| format!("{flag} needs a value"))
}

fn num<T: std::str::FromStr>(v: &str, flag: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{flag}: invalid value {v:?}"))
}

pub fn parse(argv: &[String]) -> Result<Args, String> {
    let test = argv
        .first()
        .and_then(|t| Test::parse(t))
        .ok_or_else(|| format!("unknown or missing test\n{USAGE}"))?;
    let mut a = Args {
        test,
        server: None,
        device: std::env::var("RIXL_RDMA_DEVICE").ok(),
        ib_port: 1,
        gid_index: std::env::var("RIXL_GID_INDEX")
            .ok()
            .and_then(|v| v.parse().ok()),
        sizes: Vec::new(),
        iters: if test == Test::WriteBw { 5000 } else { 1000 },
        qps: 1,
        tx_depth: if test.is_bw() { 128 } else { 1 },
        post_list: 1,
        duration: None,
        port: 18515,
        report_gbits: false,
        out_json: None,
        poll_mode: PollMode::Busy,
        coalesce: false,
        prepared: false,
        notify: Notify::Flag,
        engines: 1,
        cpu: None,
    };
    let mut all = false;
    let mut size = None;
    let mut it = argv[1..].iter();
    while let Some(arg) = it.next() {
        // Accept both "--flag value" and "--flag=value".
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let val = |it: &mut std::slice::Iter<'_, String>| -> Result<String, String> {
            match &inline {
                Some(v) => Ok(v.clone()),
                None => value(it, flag).cloned(),
            }
        };
        match flag {
            "-d" | "--ib-dev" => a.device = Some(val(&mut it)?),
            "-i" | "--ib-port" => a.ib_port = num(&val(&mut it)?, flag)?,
            "-x" | "--gid-index" => a.gid_index = Some(num(&val(&mut it)?, flag)?),
            "-s" | "--size" => size = Some(num::<u64>(&val(&mut it)?, flag)?),
            "-a" | "--all" => all = true,
            "-n" | "--iters" => a.iters = num(&val(&mut it)?, flag)?,
            "-q" | "--qp" => a.qps = num(&val(&mut it)?, flag)?,
            "-t" | "--tx-depth" => a.tx_depth = num(&val(&mut it)?, flag)?,
            "-l" | "--post_list" => a.post_list = num(&val(&mut it)?, flag)?,
            "-D" | "--duration" => {
                a.duration = Some(Duration::from_secs(num(&val(&mut it)?, flag)?))
            }
            "-F" | "--CPU-freq" => {}
            "-p" | "--port" => a.port = num(&val(&mut it)?, flag)?,
            "--report_gbits" => a.report_gbits = true,
            "--out_json" => a.out_json = a.out_json.or(Some("perftest_out.json".into())),
            "--out_json_file" => a.out_json = Some(val(&mut it)?),
            "--coalesce" => a.coalesce = true,
            "--prepared" => a.prepared = true,
            "--poll-mode" => {
                a.poll_mode = match val(&mut it)?.as_str() {
                    "busy" => PollMode::Busy,
                    "event" => PollMode::Event,
                    v => return Err(format!("--poll-mode: busy or event, not {v:?}")),
                }
            }
            "--notify" => {
                a.notify = match val(&mut it)?.as_str() {
                    "flag" => Notify::Flag,
                    "imm" => Notify::Imm,
                    v => return Err(format!("--notify: flag or imm, not {v:?}")),
                }
            }
            "--engines" => a.engines = num(&val(&mut it)?, flag)?,
            "--cpu" => a.cpu = Some(num(&val(&mut it)?, flag)?),
            "-h" | "--help" => return Err(USAGE.into()),
            f if f.starts_with('-') => return Err(format!("unknown option {f}\n{USAGE}")),
            host => {
                if a.server.replace(host.to_string()).is_some() {
                    return Err(format!("unexpected argument {host:?}"));
                }
            }
        }
    }
    if a.iters < 5 {
        return Err("-n: at least 5 iterations".into());
    }
    if a.qps == 0 || a.tx_depth == 0 || a.post_list == 0 || a.engines == 0 {
        return Err("-q, -t, -l and --engines must be positive".into());
    }
    a.sizes = if all {
        (1..=23).map(|p| 1u64 << p).collect()
    } else {
        vec![size.unwrap_or(if test.is_bw() { 65536 } else { 2 })]
    };
    if a.sizes.iter().any(|&s| s == 0 || s > (1 << 30)) {
        return Err("-s: size must be 1 B .. 1 GiB".into());
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Args, String> {
        parse(&s.split_whitespace().map(String::from).collect::<Vec<_>>())
    }

    #[test]
    fn defaults_follow_perftest() {
        let a = p("write_bw").expect("ok");
        assert_eq!(
            (a.sizes.clone(), a.iters, a.tx_depth, a.qps),
            (vec![65536], 5000, 128, 1)
        );
        let a = p("read_bw").expect("ok");
        assert_eq!(a.iters, 1000);
        let a = p("write_lat 10.0.0.1").expect("ok");
        assert_eq!((a.sizes.clone(), a.iters, a.tx_depth), (vec![2], 1000, 1));
        assert_eq!(a.server.as_deref(), Some("10.0.0.1"));
    }

    #[test]
    fn flags_and_errors() {
        let a = p("send_bw -d rxe0 -x 1 -s 4096 -n 100 -q 2 -t 64 -l 8 --report_gbits --out_json_file=o.json -F host")
            .expect("ok");
        assert_eq!(a.device.as_deref(), Some("rxe0"));
        assert_eq!(
            (
                a.gid_index,
                a.sizes.clone(),
                a.iters,
                a.qps,
                a.tx_depth,
                a.post_list
            ),
            (Some(1), vec![4096], 100, 2, 64, 8)
        );
        assert!(a.report_gbits);
        assert_eq!(a.out_json.as_deref(), Some("o.json"));
        let a = p("write_bw -a").expect("ok");
        assert_eq!(a.sizes.len(), 23);
        assert_eq!((a.sizes[0], a.sizes[22]), (2, 8 << 20));
        assert!(p("write_bw --bogus")
            .expect_err("unknown")
            .contains("unknown option --bogus"));
        assert!(p("frobnicate").is_err());
        assert!(p("write_bw -n 2").is_err());
        assert!(p("write_bw -s").is_err());
        assert!(p("write_bw a b").is_err());
    }
}
