//! `blacklist_urls.py`: drop URLs whose registrable domain or file extension is
//! blacklisted, short or malformed URLs, and repeats of an already kept URL.
//!
//! The original's extension tuple misses a comma and fuses `.7z` and `.ai` into `.7z.ai`,
//! so it filters neither; we list both, as its authors intended. Kept URLs are written in
//! input order (the original writes Python set order, which changes from run to run).

use regex::Regex;
use std::collections::HashSet;
use std::sync::LazyLock;

/// Registrable-domain labels (the name left of the public suffix) that are dropped.
const DOMAIN_BLACKLIST: &[&str] = &[
    "500px",
    "aapks",
    "akamaihd",
    "amazon",
    "apple",
    "artifactfire",
    "artstation",
    "awwni",
    "bandcamp",
    "battleforthenet",
    "coinscalendar",
    "dailymotion",
    "deviantart",
    "discord",
    "discordapp",
    "dlapkandroid",
    "dropbox",
    "e621",
    "ebay",
    "edealinfo",
    "erome",
    "eroshare",
    "explosm",
    "facebook",
    "fbcdn",
    "flickr",
    "furaffinity",
    "futhead",
    "gatopardo",
    "gfycat",
    "gifsound",
    "gifsoup",
    "giphy",
    "github",
    "google",
    "gunprime",
    "gyazo",
    "horsefucker",
    "hotdealstar",
    "imagefap",
    "imageshack",
    "imgflip",
    "imgur",
    "instagram",
    "karmadecay",
    "kryptocal",
    "kym-cdn",
    "liveleak",
    "livememe",
    "lmgtfy",
    "magaimg",
    "memegenerator",
    "minorplanetcenter",
    "minus",
    "mobafire",
    "morejpeg",
    "nocookie",
    "pcpartpicker",
    "photobucket",
    "pinimg",
    "pinterest",
    "pixiv",
    "pornhub",
    "prntscr",
    "puu",
    "qkme",
    "quickmeme",
    "radd",
    "redd",
    "reddit",
    "reddit-stream",
    "redditlog",
    "redditmedia",
    "reddituploads",
    "redtube",
    "reupp",
    "reverb",
    "roanoke",
    "rollingstone",
    "sli",
    "soundcloud",
    "soundgasm",
    "spankbang",
    "spotify",
    "strawpoll",
    "streamable",
    "timeanddate",
    "tinypic",
    "touhouradio",
    "tumblr",
    "twimg",
    "twitch",
    "twitter",
    "vid",
    "vimeo",
    "vine",
    "vkaao",
    "vocaroo",
    "voyagefusion",
    "walmart",
    "wciu",
    "wikimedia",
    "wikipedia",
    "xhamster",
    "xkcd",
    "xvideos",
    "youtu",
    "youtube",
    "youtubedoubler",
    "ytimg",
    "zillexplorer",
];

/// File extensions (matched on the lower-cased URL without its query string).
const EXTENSION_BLACKLIST: &[&str] = &[
    ".3gp", ".7z", ".ai", ".aif", ".apk", ".app", ".avi", ".bin", ".bmp", ".bz2", ".css", ".csv",
    ".dat", ".deb", ".dmg", ".doc", ".docx", ".exe", ".gif", ".gifv", ".gz", ".iso", ".jar",
    ".jpeg", ".jpg", ".js", ".log", ".mid", ".midi", ".mkv", ".mov", ".mp3", ".mp4", ".mpeg",
    ".mpg", ".ogg", ".ogv", ".otf", ".pdf", ".pkg", ".png", ".pps", ".ppt", ".pptx", ".psd", ".py",
    ".qt", ".ram", ".rar", ".sql", ".svg", ".swf", ".tar.gz", ".tar", ".tgz", ".tiff", ".ttf",
    ".txt", ".wav", ".webm", ".wma", ".wmv", ".xls", ".xlsx", ".xml", ".xz", ".zip",
];

/// URLs of at most this many characters are dropped as too short.
const SHORT_URL_MAX_CHARS: usize = 8;

/// The original's URL sanity pattern: scheme, dotted host (or IPv4), optional port, path.
static URL_PATTERN: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)^https?://(?:(?:[A-Z0-9](?:[A-Z0-9-]{0,61}[A-Z0-9])?\.)+(?:[A-Z]{2,6}\.?|[A-Z0-9-]{2,}\.?)|\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})(?::\d+)?(?:/?|[/?]\S+)$",
    )
    .expect("static URL pattern compiles")
});

/// Why a URL was dropped, in the order the checks run (first match wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UrlRejection {
    DomainBlacklisted,
    ExtensionBlacklisted,
    Short,
    Malformed,
    Duplicate,
}

impl UrlRejection {
    pub fn label(self) -> &'static str {
        match self {
            UrlRejection::DomainBlacklisted => "domain blacklisted",
            UrlRejection::ExtensionBlacklisted => "extension blacklisted",
            UrlRejection::Short => "short url (<=8)",
            UrlRejection::Malformed => "malformed url",
            UrlRejection::Duplicate => "duplicate url",
        }
    }
}

/// The registrable-domain label of a URL as `tldextract` (ICANN suffixes only) reports it:
/// `https://en.wikipedia.org/x` → `wikipedia`, `user.github.io` → `github`.
pub fn domain_label(url: &str) -> String {
    let host = host_of(url);
    let labels: Vec<&str> = host.split('.').filter(|l| !l.is_empty()).collect();
    if labels.is_empty() {
        return String::new();
    }
    if host.parse::<std::net::Ipv4Addr>().is_ok() {
        return host;
    }
    let suffix_labels = icann_suffix_labels(&host);
    if suffix_labels >= labels.len() {
        return String::new();
    }
    labels[labels.len() - 1 - suffix_labels].to_string()
}

/// Number of trailing labels of `host` that form its ICANN public suffix (0 when the
/// top-level label is not a known suffix, as `tldextract` treats unknown TLDs).
fn icann_suffix_labels(host: &str) -> usize {
    let mut candidate = host;
    loop {
        let Some(suffix) = psl::suffix(candidate.as_bytes()) else {
            return 0;
        };
        let suffix_str = std::str::from_utf8(suffix.as_bytes()).unwrap_or("");
        match suffix.typ() {
            Some(psl::Type::Icann) => return suffix_str.split('.').count(),
            None => return 0,
            Some(psl::Type::Private) => match suffix_str.split_once('.') {
                Some((_, parent)) => candidate = parent,
                None => return 0,
            },
        }
    }
}

/// Host part of a URL: after the scheme, before path/query/fragment, without user info,
/// port or trailing dot; lower-cased.
fn host_of(url: &str) -> String {
    let rest = match url.find("//") {
        Some(i)
            if url[..i]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.:".contains(c)) =>
        {
            &url[i + 2..]
        }
        _ => url,
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or("");
    let host = host_port.split(':').next().unwrap_or("");
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Applies the original's checks in order; keeps a set of URLs seen so far for dedup.
#[derive(Default)]
pub struct UrlFilter {
    domains: HashSet<&'static str>,
    kept: HashSet<String>,
}

impl UrlFilter {
    pub fn new() -> Self {
        Self {
            domains: DOMAIN_BLACKLIST.iter().copied().collect(),
            kept: HashSet::new(),
        }
    }

    /// The reason a URL must be dropped, ignoring duplicates (stateless, parallel-safe).
    pub fn static_rejection(&self, url: &str) -> Option<UrlRejection> {
        if self.domains.contains(domain_label(url).as_str()) {
            return Some(UrlRejection::DomainBlacklisted);
        }
        let path = url.split('?').next().unwrap_or("").to_lowercase();
        if EXTENSION_BLACKLIST.iter().any(|ext| path.ends_with(ext)) {
            return Some(UrlRejection::ExtensionBlacklisted);
        }
        if url.chars().count() <= SHORT_URL_MAX_CHARS {
            return Some(UrlRejection::Short);
        }
        if !URL_PATTERN.is_match(url) {
            return Some(UrlRejection::Malformed);
        }
        None
    }

    /// Full check including the duplicate rule; records the URL when it is kept.
    pub fn check(&mut self, url: &str) -> Option<UrlRejection> {
        self.static_rejection(url)
            .or_else(|| self.check_duplicate(url))
    }

    /// The duplicate rule alone, for URLs that passed [`Self::static_rejection`].
    pub fn check_duplicate(&mut self, url: &str) -> Option<UrlRejection> {
        if self.kept.insert(url.to_string()) {
            None
        } else {
            Some(UrlRejection::Duplicate)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_have_the_originals_sizes_with_the_fused_entry_split() {
        assert_eq!(DOMAIN_BLACKLIST.len(), 111);
        assert_eq!(EXTENSION_BLACKLIST.len(), 67);
    }

    #[test]
    fn domain_labels_follow_tldextract() {
        assert_eq!(domain_label("https://en.wikipedia.org/wiki/X"), "wikipedia");
        assert_eq!(domain_label("http://www.bbc.co.uk/news"), "bbc");
        assert_eq!(domain_label("https://user.github.io/page"), "github");
        assert_eq!(domain_label("http://me@i.imgur.com:8080/a.png"), "imgur");
        assert_eq!(domain_label("http://10.0.0.1/x"), "10.0.0.1");
    }

    #[test]
    fn checks_run_in_order_and_dedup() {
        let mut f = UrlFilter::new();
        let r = |f: &mut UrlFilter, u: &str| f.check(u);
        assert_eq!(
            r(&mut f, "https://youtube.com/watch?v=1"),
            Some(UrlRejection::DomainBlacklisted)
        );
        assert_eq!(
            r(&mut f, "http://example.com/a.PDF?x=1"),
            Some(UrlRejection::ExtensionBlacklisted)
        );
        assert_eq!(
            r(&mut f, "http://example.com/a.7z"),
            Some(UrlRejection::ExtensionBlacklisted)
        );
        assert_eq!(r(&mut f, "http://a"), Some(UrlRejection::Short));
        assert_eq!(
            r(&mut f, "ftp://example.com/x"),
            Some(UrlRejection::Malformed)
        );
        assert_eq!(
            r(&mut f, "http://exa mple.com/x"),
            Some(UrlRejection::Malformed)
        );
        assert_eq!(r(&mut f, "https://example.com/story"), None);
        assert_eq!(
            r(&mut f, "https://example.com/story"),
            Some(UrlRejection::Duplicate)
        );
    }
}
