//! A tiny blocking RESP2 client over a [`TcpStream`], for the harness and its tests.
//!
//! It exists so that [`crate::cluster`] can ask nodes `CLUSTER INFO`, `ROLE`, `MIGRATE` … and
//! tests can read and write keys without an async runtime or the `redis` crate. It sends
//! binary-safe RESP arrays, parses RESP2 replies (no RESP3, no pipelining, no pub/sub) and
//! returns server errors as [`Value::Error`] (the caller decides what an error means, e.g. a
//! `MOVED` redirect). It is not a production client: Tidemark's own code uses the `redis` crate.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `$-1` or `*-1`.
    Nil,
    /// `:n`.
    Int(i64),
    /// `+text`.
    Status(String),
    /// `$n` bulk string.
    Bulk(Vec<u8>),
    /// `*n` array.
    Array(Vec<Value>),
    /// `-ERR text`: the whole line after `-`.
    Error(String),
}

impl Value {
    /// The text of a status or bulk reply (lossy UTF-8), `None` for other replies.
    pub fn text(&self) -> Option<String> {
        match self {
            Value::Status(s) => Some(s.clone()),
            Value::Bulk(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    /// The integer of an `:n` reply.
    pub fn int(&self) -> Option<i64> {
        match self {
            Value::Int(n) => Some(*n),
            _ => None,
        }
    }

    /// True for `+OK`.
    pub fn is_ok(&self) -> bool {
        matches!(self, Value::Status(s) if s == "OK")
    }
}

/// One connection to one server.
pub struct Conn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    addr: SocketAddr,
}

impl Conn {
    /// Connects (with `timeout` for the connect and for every later read and write) and, when
    /// `password` is given, authenticates with `AUTH`. A rejected password is an
    /// [`std::io::ErrorKind::PermissionDenied`] error.
    pub fn connect(
        addr: SocketAddr,
        password: Option<&str>,
        timeout: Duration,
    ) -> std::io::Result<Conn> {
        let s = TcpStream::connect_timeout(&addr, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        s.set_nodelay(true)?;
        let mut c = Conn {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
            addr,
        };
        if let Some(p) = password {
            match c.call(&["AUTH", p])? {
                v if v.is_ok() => {}
                other => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!("AUTH on {addr}: {other:?}"),
                    ))
                }
            }
        }
        Ok(c)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends one command (binary-safe arguments) and reads its reply.
    pub fn call<A: AsRef<[u8]>>(&mut self, args: &[A]) -> std::io::Result<Value> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            let a = a.as_ref();
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.writer.write_all(&out)?;
        read_value(&mut self.reader)
    }
}

fn bad(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

fn read_line(r: &mut impl BufRead) -> std::io::Result<String> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\r\n") {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed in the middle of a reply",
        ));
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|_| bad("reply line is not UTF-8"))
}

fn read_value(r: &mut impl BufRead) -> std::io::Result<Value> {
    let line = read_line(r)?;
    let (kind, rest) = line.split_at(line.len().min(1));
    let num = || -> std::io::Result<i64> {
        rest.parse()
            .map_err(|_| bad(format!("bad length/integer: {line:?}")))
    };
    Ok(match kind {
        "+" => Value::Status(rest.to_string()),
        "-" => Value::Error(rest.to_string()),
        ":" => Value::Int(num()?),
        "$" => {
            let n = num()?;
            if n < 0 {
                return Ok(Value::Nil);
            }
            let mut buf = vec![0u8; n as usize + 2];
            std::io::Read::read_exact(r, &mut buf)?;
            buf.truncate(n as usize);
            Value::Bulk(buf)
        }
        "*" => {
            let n = num()?;
            if n < 0 {
                return Ok(Value::Nil);
            }
            let mut items = Vec::with_capacity(n as usize);
            for _ in 0..n {
                items.push(read_value(r)?);
            }
            Value::Array(items)
        }
        _ => return Err(bad(format!("unknown reply type: {line:?}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_reply_kind() {
        let wire = b"+OK\r\n-ERR no\r\n:42\r\n$3\r\na\r\n\r\n$-1\r\n*2\r\n$1\r\nx\r\n*-1\r\n*0\r\n";
        let mut r = BufReader::new(&wire[..]);
        assert_eq!(read_value(&mut r).unwrap(), Value::Status("OK".into()));
        assert_eq!(read_value(&mut r).unwrap(), Value::Error("ERR no".into()));
        assert_eq!(read_value(&mut r).unwrap(), Value::Int(42));
        assert_eq!(read_value(&mut r).unwrap(), Value::Bulk(b"a\r\n".to_vec()));
        assert_eq!(read_value(&mut r).unwrap(), Value::Nil);
        assert_eq!(
            read_value(&mut r).unwrap(),
            Value::Array(vec![Value::Bulk(b"x".to_vec()), Value::Nil])
        );
        assert_eq!(read_value(&mut r).unwrap(), Value::Array(vec![]));
        assert!(read_value(&mut r).is_err(), "EOF is an error");
        let mut r = BufReader::new(&b"?what\r\n"[..]);
        assert!(read_value(&mut r).is_err());
    }
}
