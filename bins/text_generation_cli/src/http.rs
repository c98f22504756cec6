//! Just enough HTTP/1.1 to PUT a body and read the answer, so the CLI needs no HTTP stack.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// `method path` with a JSON `payload` on `server` (host:port); returns the status code and the body.
pub fn send(server: &str, method: &str, path: &str, payload: &[u8]) -> Result<(u16, Vec<u8>)> {
    let mut stream =
        TcpStream::connect(server).with_context(|| format!("cannot connect to {server}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(3600)))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {server}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        payload.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(payload)?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .with_context(|| format!("reading the answer of {server}"))?;
    parse_response(&response).with_context(|| format!("{server} sent a malformed HTTP response"))
}

fn parse_response(response: &[u8]) -> Result<(u16, Vec<u8>)> {
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of headers")?;
    let head = std::str::from_utf8(&response[..split])?;
    let body = &response[split + 4..];
    let status_line = head.lines().next().context("no status line")?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .context("no status code")?
        .parse()?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
    });
    Ok((
        status,
        if chunked {
            dechunk(body)?
        } else {
            body.to_vec()
        },
    ))
}

fn dechunk(mut body: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("truncated chunk size")?;
        let size = usize::from_str_radix(
            std::str::from_utf8(&body[..end])?
                .split(';')
                .next()
                .unwrap_or("")
                .trim(),
            16,
        )?;
        body = &body[end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if body.len() < size + 2 {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_chunked_responses() {
        let plain = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 4\r\n\r\n\"no\"";
        assert_eq!(parse_response(plain).unwrap(), (400, b"\"no\"".to_vec()));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n3\r\n\":1\r\n1\r\n}\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(chunked).unwrap(),
            (200, b"{\"a\":1}".to_vec())
        );
        assert!(parse_response(b"garbage").is_err());
    }
}
