//! perftest-compatible command line (clap): the same flags, meanings and defaults as ib_write_bw
//! & co., plus the `sweep` (nixlbench) and `file` (fio) subcommands.

use std::ffi::OsString;
use std::fmt::Display;
use std::time::Duration;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, Parser, ValueEnum};
use rixl::runtime::PollMode;

use super::{file, sweep};

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
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

/// `--poll-mode`'s values (rixl's `PollMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PollArg {
    /// Poll the completion queue on the engine's core.
    Busy,
    /// Wait for completion events off the core.
    Event,
}

impl From<PollArg> for PollMode {
    fn from(p: PollArg) -> PollMode {
        match p {
            PollArg::Busy => PollMode::Busy,
            PollArg::Event => PollMode::Event,
        }
    }
}

/// The resolved options of a perftest-style test (test-dependent defaults applied).
#[derive(Debug, Clone)]
pub struct Args {
    pub test: Test,
    pub server: Option<String>,
    pub device: Option<String>,
    pub ib_port: u8,
    /// The queue pairs' local ACK timeout exponent (4.096 µs x 2^N).
    pub qp_timeout: u8,
    pub gid_index: Option<u32>,
    pub sizes: Vec<u64>,
    pub iters: u64,
    pub qps: u32,
    pub tx_depth: u32,
    /// Receive buffers per connection (`EngineConfig::recv_buffers`; the engine's default when
    /// not given).
    pub rx_depth: Option<u32>,
    pub post_list: u32,
    pub duration: Option<Duration>,
    pub port: u16,
    pub report_gbits: bool,
    pub out_json: Option<String>,
    pub poll_mode: PollMode,
    /// CQ polls a lone waiting transfer makes itself (`EngineConfig::spin_polls`).
    pub spin_polls: Option<u32>,
    /// Requests per doorbell at most (`EngineConfig::post_batch`).
    pub post_batch: u32,
    /// Coalesce small transfers' doorbells and signals (the engine's default; `--no-coalesce`
    /// turns it off).
    pub coalesce: bool,
    /// Prepare each transfer once and re-post it (`--prepared`: `Engine::prepare` + `post`).
    pub prepared: bool,
    /// SEND tests: send with `Engine::send`, which copies each message into the engine's
    /// message buffers (`--copy`), instead of `Engine::send_from` the registered buffer.
    pub copy: bool,
    /// SEND tests: receive with `Engine::recv`, which copies each payload out of its receive
    /// buffer (`--recv-copy`), instead of `Engine::recv_with` reading it in place.
    pub recv_copy: bool,
    /// How write_lat detects arrival: a flag byte in memory (perftest's way) or WRITE_WITH_IMM.
    pub notify: Notify,
    pub engines: u32,
    pub cpu: Option<usize>,
    /// The buffer in GPU memory (`--use_cuda[=ID]`): the GPU's CUDA ordinal.
    pub use_cuda: Option<i32>,
    /// The GPU buffer registered through dma-buf only (`--use_cuda_dmabuf`).
    pub use_cuda_dmabuf: bool,
}

/// A perftest test's command line, as parsed (defaults that depend on the test still unset).
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "\
Run without a server host to be the server; with one to be the client, which prints perftest's \
columns.")]
pub struct PerftestArgs {
    /// RDMA device [default: first, or $RIXL_RDMA_DEVICE]
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    device: Option<String>,
    /// Port of the device
    #[arg(
        short = 'i',
        long = "ib-port",
        value_name = "PORT",
        default_value_t = 1
    )]
    ib_port: u8,
    /// QP timeout: a request waits 4.096 us * 2^N for its ACK before it is retransmitted
    #[arg(short = 'u', long = "qp-timeout", value_name = "N", default_value_t = 14,
          value_parser = clap::value_parser!(u8).range(0..=31))]
    qp_timeout: u8,
    /// GID index [default: $RIXL_GID_INDEX or 1]
    #[arg(short = 'x', long = "gid-index", value_name = "IDX")]
    gid_index: Option<u32>,
    /// Message size in bytes, 1 B .. 1 GiB [default: 65536 for bw tests, 2 for lat tests]
    #[arg(short = 's', long = "size", value_name = "BYTES",
          value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    size: Option<u64>,
    /// All sizes, 2 B .. 8 MiB (powers of two)
    #[arg(short = 'a', long = "all")]
    all: bool,
    /// Iterations, at least 5 [default: 5000 for write_bw, 1000 otherwise]
    #[arg(short = 'n', long = "iters", value_name = "N",
          value_parser = clap::value_parser!(u64).range(5..))]
    iters: Option<u64>,
    /// Queue pairs
    #[arg(short = 'q', long = "qp", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    qps: u32,
    /// Outstanding requests [default: 128 for bw tests, 1 for lat tests]
    #[arg(short = 't', long = "tx-depth", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    tx_depth: Option<u32>,
    /// Receive buffers posted per queue pair (SEND tests) [default: the engine's, 64]
    #[arg(short = 'r', long = "rx-depth", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    rx_depth: Option<u32>,
    /// Descriptors per transfer (one doorbell)
    #[arg(short = 'l', long = "post_list", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    post_list: u32,
    /// Run for this many seconds instead of -n iterations
    #[arg(short = 'D', long = "duration", value_name = "SECONDS")]
    duration: Option<u64>,
    /// Accepted and ignored (no CPU frequency warning is printed anyway)
    #[arg(short = 'F', long = "CPU-freq")]
    _cpu_freq: bool,
    /// TCP port of the out-of-band exchange
    #[arg(
        short = 'p',
        long = "port",
        value_name = "PORT",
        default_value_t = 18515
    )]
    port: u16,
    /// Report bandwidth in Gb/sec
    #[arg(long = "report_gbits")]
    report_gbits: bool,
    /// Write the report as JSON (perftest_out.json)
    #[arg(long = "out_json")]
    out_json: bool,
    /// Write the JSON report to this file
    #[arg(long = "out_json_file", value_name = "FILE")]
    out_json_file: Option<String>,
    /// Engine completion mode
    #[arg(long = "poll-mode", value_name = "MODE", value_enum, default_value_t = PollArg::Busy,
          help_heading = "rixl options")]
    poll_mode: PollArg,
    /// CQ polls a transfer alone in flight makes itself before it waits for the engine's
    /// progress task (0: none; default: the engine's)
    #[arg(long = "spin-polls", value_name = "N", help_heading = "rixl options")]
    spin_polls: Option<u32>,
    /// Work requests per doorbell at most (a coalesced batch, a descriptor list)
    #[arg(long = "post-batch", value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=1024), help_heading = "rixl options")]
    post_batch: u32,
    /// Share doorbells and signaled completions among concurrent small transfers (the default;
    /// kept for scripts that pass it)
    #[arg(long = "coalesce", help_heading = "rixl options")]
    coalesce: bool,
    /// Post every transfer with its own doorbell (coalescing off)
    #[arg(
        long = "no-coalesce",
        conflicts_with = "coalesce",
        help_heading = "rixl options"
    )]
    no_coalesce: bool,
    /// Check and plan each transfer once, then re-post it (like NIXL's prepared transfer
    /// requests; READ/WRITE tests)
    #[arg(long = "prepared", help_heading = "rixl options")]
    prepared: bool,
    /// SEND tests: send each message with `Engine::send`, which copies it into the engine's
    /// message buffers, instead of zero-copy from the registered buffer as perftest does
    #[arg(long = "copy", help_heading = "rixl options")]
    copy: bool,
    /// SEND tests: receive each message with `Engine::recv`, which copies it out of its receive
    /// buffer, instead of reading it in place as perftest does (`Engine::recv_with`)
    #[arg(long = "recv-copy", help_heading = "rixl options")]
    recv_copy: bool,
    /// write_lat arrival: a flag byte in memory, as perftest, or WRITE_WITH_IMM and a receive
    /// completion
    #[arg(long = "notify", value_name = "HOW", value_enum, default_value_t = Notify::Flag,
          help_heading = "rixl options")]
    notify: Notify,
    /// Engines (cores) on the client for bw tests
    #[arg(long = "engines", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..), help_heading = "rixl options")]
    engines: u32,
    /// First CPU to pin engines to [default: client the first CPU this process may run on, server the last]
    #[arg(long = "cpu", value_name = "N", help_heading = "rixl options")]
    cpu: Option<usize>,
    /// Use CUDA memory for the buffer, on GPU ID (GPUDirect RDMA; bandwidth tests)
    #[arg(long = "use_cuda", value_name = "ID", num_args = 0..=1, require_equals = true,
          default_missing_value = "0")]
    use_cuda: Option<i32>,
    /// Register the CUDA buffer through dma-buf only (implies --use_cuda)
    #[arg(long = "use_cuda_dmabuf")]
    use_cuda_dmabuf: bool,
    /// The server to connect to (none: be the server)
    #[arg(value_name = "SERVER_HOST")]
    server: Option<String>,
}

impl PerftestArgs {
    /// Applies the defaults that depend on `test` and on the environment.
    fn resolve(self, test: Test) -> Args {
        let sizes = if self.all {
            (1..=23).map(|p| 1u64 << p).collect()
        } else {
            vec![self.size.unwrap_or(if test.is_bw() { 65536 } else { 2 })]
        };
        Args {
            test,
            server: self.server,
            device: self
                .device
                .or_else(|| std::env::var("RIXL_RDMA_DEVICE").ok()),
            ib_port: self.ib_port,
            qp_timeout: self.qp_timeout,
            gid_index: self.gid_index.or_else(|| {
                std::env::var("RIXL_GID_INDEX")
                    .ok()
                    .and_then(|v| v.parse().ok())
            }),
            sizes,
            iters: self
                .iters
                .unwrap_or(if test == Test::WriteBw { 5000 } else { 1000 }),
            qps: self.qps,
            tx_depth: self.tx_depth.unwrap_or(if test.is_bw() { 128 } else { 1 }),
            rx_depth: self.rx_depth,
            post_list: self.post_list,
            duration: self.duration.map(Duration::from_secs),
            port: self.port,
            report_gbits: self.report_gbits,
            out_json: self
                .out_json_file
                .or_else(|| self.out_json.then(|| "perftest_out.json".into())),
            poll_mode: self.poll_mode.into(),
            spin_polls: self.spin_polls,
            post_batch: self.post_batch,
            coalesce: !self.no_coalesce,
            prepared: self.prepared,
            copy: self.copy,
            recv_copy: self.recv_copy,
            notify: self.notify,
            engines: self.engines,
            cpu: self.cpu,
            use_cuda: self.use_cuda.or(self.use_cuda_dmabuf.then_some(0)),
            use_cuda_dmabuf: self.use_cuda_dmabuf,
        }
    }
}

/// `rixl-perf TEST [options] [server-host]`, `rixl-perf sweep [...]`, `rixl-perf file [...]`.
#[derive(Debug, Parser)]
#[command(
    name = "rixl-perf",
    about = "perftest-compatible benchmarks of the rixl runtime (same flags, meanings and defaults \
             as ib_write_bw & co.), a nixlbench-style sweep and a fio-style FILE tier benchmark",
    arg_required_else_help = true
)]
enum Cli {
    /// RDMA WRITE bandwidth (ib_write_bw)
    #[command(name = "write_bw")]
    WriteBw(PerftestArgs),
    /// RDMA READ bandwidth (ib_read_bw)
    #[command(name = "read_bw")]
    ReadBw(PerftestArgs),
    /// SEND bandwidth (ib_send_bw)
    #[command(name = "send_bw")]
    SendBw(PerftestArgs),
    /// RDMA WRITE ping-pong latency (ib_write_lat)
    #[command(name = "write_lat")]
    WriteLat(PerftestArgs),
    /// RDMA READ latency (ib_read_lat)
    #[command(name = "read_lat")]
    ReadLat(PerftestArgs),
    /// SEND ping-pong latency (ib_send_lat)
    #[command(name = "send_lat")]
    SendLat(PerftestArgs),
    /// nixlbench-style block size x batch size sweep in one process (nixlbench's flags)
    Sweep(sweep::SweepArgs),
    /// fio-style benchmark of the FILE tier (fio's flag names and meanings)
    File(file::FileArgs),
}

/// What to run.
#[derive(Debug)]
pub enum Mode {
    Perf(Args),
    Sweep(sweep::SweepArgs),
    File(file::FileArgs),
}

/// Parses a command line (`argv[0]` is the program name).
///
/// # Errors
/// clap's error for a bad command line, `--help` included (it prints the help); or a usage error
/// of a subcommand whose flags do not fit together.
pub fn parse<I, T>(argv: I) -> Result<Mode, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    Ok(match Cli::try_parse_from(argv)? {
        Cli::WriteBw(p) => Mode::Perf(p.resolve(Test::WriteBw)),
        Cli::ReadBw(p) => Mode::Perf(p.resolve(Test::ReadBw)),
        Cli::SendBw(p) => Mode::Perf(p.resolve(Test::SendBw)),
        Cli::WriteLat(p) => Mode::Perf(cuda_bw_only(p.resolve(Test::WriteLat))?),
        Cli::ReadLat(p) => Mode::Perf(cuda_bw_only(p.resolve(Test::ReadLat))?),
        Cli::SendLat(p) => Mode::Perf(cuda_bw_only(p.resolve(Test::SendLat))?),
        Cli::Sweep(w) => {
            w.check().map_err(|m| usage_error("sweep", m))?;
            Mode::Sweep(w)
        }
        Cli::File(f) => {
            f.check().map_err(|m| usage_error("file", m))?;
            Mode::File(f)
        }
    })
}

/// Refuses `--use_cuda` for a latency test: those spin on a byte of the buffer from the CPU,
/// which GPU memory is not.
fn cuda_bw_only(a: Args) -> Result<Args, clap::Error> {
    if a.use_cuda.is_some() {
        return Err(usage_error(
            a.test.name(),
            "--use_cuda: bandwidth tests only (a latency test spins on a byte of its buffer from the CPU)",
        ));
    }
    Ok(a)
}

/// A usage error of subcommand `sub` (clap's format: the message, then the usage line).
fn usage_error(sub: &str, msg: impl Display) -> clap::Error {
    let mut cmd = Cli::command();
    cmd.build();
    match cmd.find_subcommand_mut(sub) {
        Some(c) => c.error(ErrorKind::ValueValidation, msg),
        None => cmd.error(ErrorKind::ValueValidation, msg),
    }
}

/// The text of a command-line error: clap's, with an unknown option worded as perftest's
/// ("unknown option --bogus").
pub fn message(e: &clap::Error) -> String {
    let text = e.render().to_string();
    match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg))
            if e.kind() == ErrorKind::UnknownArgument && arg.starts_with('-') =>
        {
            let clap_words = format!("unexpected argument '{arg}' found");
            if text.contains(&clap_words) {
                text.replacen(&clap_words, &format!("unknown option {arg}"), 1)
            } else {
                format!("error: unknown option {arg}\n{text}")
            }
        }
        _ => text,
    }
}

/// Prints a command-line error (help and the like to stdout) and exits with clap's status: 0 for
/// `--help`, 2 for a bad command line.
pub fn exit(e: &clap::Error) -> ! {
    if e.use_stderr() && e.kind() == ErrorKind::UnknownArgument {
        eprint!("{}", message(e));
        std::process::exit(e.exit_code());
    }
    e.exit()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Args, String> {
        match parse(std::iter::once("rixl-perf").chain(s.split_whitespace())) {
            Ok(Mode::Perf(a)) => Ok(a),
            Ok(m) => Err(format!("not a perftest test: {m:?}")),
            Err(e) => Err(message(&e)),
        }
    }

    #[test]
    fn defaults_follow_perftest() {
        let a = p("write_bw").expect("ok");
        assert_eq!(
            (a.sizes.clone(), a.iters, a.tx_depth, a.qps),
            (vec![65536], 5000, 128, 1)
        );
        assert_eq!(
            (a.ib_port, a.post_list, a.port, a.engines),
            (1, 1, 18515, 1)
        );
        assert_eq!((a.poll_mode, a.notify), (PollMode::Busy, Notify::Flag));
        assert!(a.server.is_none() && a.out_json.is_none() && a.duration.is_none());
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
        assert_eq!(a.server.as_deref(), Some("host"));
        let a = p("write_bw -a").expect("ok");
        assert_eq!(a.sizes.len(), 23);
        assert_eq!((a.sizes[0], a.sizes[22]), (2, 8 << 20));
        // perftest's CUDA flags: the buffer on a GPU, dma-buf only with --use_cuda_dmabuf.
        assert_eq!(p("write_bw --use_cuda").expect("ok").use_cuda, Some(0));
        let a = p("read_bw --use_cuda=3 h").expect("ok");
        assert_eq!((a.use_cuda, a.use_cuda_dmabuf), (Some(3), false));
        let a = p("write_bw --use_cuda_dmabuf").expect("ok");
        assert_eq!((a.use_cuda, a.use_cuda_dmabuf), (Some(0), true));
        assert_eq!(p("write_bw").expect("ok").use_cuda, None);
        assert!(p("write_bw --use_cuda=x").is_err());
        let e = p("write_lat --use_cuda").expect_err("latency tests spin on a host byte");
        assert!(e.contains("bandwidth tests only"), "{e}");
        let e = p("write_bw --bogus").expect_err("unknown");
        assert!(e.contains("unknown option --bogus"), "{e}");
        assert!(p("frobnicate").is_err());
        assert!(p("").is_err(), "a test is required");
        assert!(p("write_bw -n 2").is_err());
        assert!(p("write_bw -n 5").is_ok());
        assert!(p("write_bw -s").is_err());
        assert!(p("write_bw -s 0").is_err());
        assert!(p("write_bw -s 1073741825").is_err());
        assert!(p("write_bw -s 1073741824").is_ok());
        assert!(p("write_bw a b").is_err());
        for zero in ["-q 0", "-t 0", "-l 0", "--engines 0"] {
            assert!(p(&format!("write_bw {zero}")).is_err(), "{zero}");
        }
    }

    #[test]
    fn rixl_options() {
        let a = p("write_lat --poll-mode event --coalesce --prepared --notify imm --engines 2 --cpu 3 -D 5 -i 2 -p 19000 --out_json")
            .expect("ok");
        assert_eq!(
            (
                a.poll_mode,
                a.coalesce,
                a.prepared,
                a.notify,
                a.engines,
                a.cpu
            ),
            (PollMode::Event, true, true, Notify::Imm, 2, Some(3))
        );
        assert_eq!(
            (a.duration, a.ib_port, a.port),
            (Some(Duration::from_secs(5)), 2, 19000)
        );
        assert_eq!(a.out_json.as_deref(), Some("perftest_out.json"));
        let a = p("write_bw --out_json --out_json_file f.json").expect("ok");
        assert_eq!(a.out_json.as_deref(), Some("f.json"));
        assert!(p("write_bw --poll-mode spin").is_err());
        assert!(p("write_bw --notify=carrier-pigeon").is_err());
        // The invocations of perf/benches and scripts/demo.
        let a =
            p("write_bw -d rxe0 -x 1 -s 65536 -n 5000 -F -l 16 --prepared --coalesce 127.0.0.1")
                .expect("ok");
        assert_eq!((a.post_list, a.prepared, a.coalesce), (16, true, true));
        assert!(p("write_lat -d rxe0 -x 1 -s 64 -n 5000 -F --notify imm 127.0.0.1").is_ok());
        // Coalescing is the default; --no-coalesce turns it off.
        assert!(p("write_bw").expect("ok").coalesce);
        assert!(!p("write_bw --no-coalesce").expect("ok").coalesce);
        assert!(p("write_bw --coalesce --no-coalesce").is_err());
        assert_eq!(
            p("read_lat --spin-polls 0").expect("ok").spin_polls,
            Some(0)
        );
        assert_eq!(p("read_lat").expect("ok").spin_polls, None);
        assert!(p("write_bw -d rxe0 -x 1 -s 4096 -n 1000 -F -t 1 -p 18601 127.0.0.1").is_ok());
    }

    #[test]
    fn help_is_not_a_run() {
        let e = parse(["rixl-perf", "write_bw", "-h"]).expect_err("help");
        assert_eq!(e.kind(), ErrorKind::DisplayHelp);
        let help = e.render().to_string();
        for flag in [
            "--ib-dev",
            "--post_list",
            "--CPU-freq",
            "--out_json_file",
            "--poll-mode",
        ] {
            assert!(help.contains(flag), "{flag} in {help}");
        }
    }
}
