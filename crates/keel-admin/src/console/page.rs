//! The console's page shell and login page: inline CSS, a few lines of
//! script for the live stream and ages, no external assets (the console
//! must work on an air-gapped operations network).

use super::html::escape;

const STYLE: &str = r#"
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f5f6f8}
header{background:#1d2330;color:#fff;padding:.6rem 1.2rem;display:flex;gap:1rem;align-items:center}
header h1{font-size:1.1rem;margin:0;flex:1}
#live{font-size:.8rem;padding:.1rem .5rem;border-radius:1rem;background:#8a8f99}
#live[data-live="true"]{background:#1f9d55}
main{padding:1rem 1.2rem;max-width:1400px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;margin:0 0 1rem;padding:.4rem .9rem}
h2{font-size:1rem;margin:.4rem 0}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:.3rem .4rem;border-top:1px solid #eceef2;vertical-align:top}
td.err{color:#a12;max-width:28rem;word-break:break-word}
code{font-size:12px}
.pill{display:inline-block;padding:0 .5rem;border-radius:1rem;background:#eceef2}
.pill.stuck,.pill.failed,.pill.open,.pill.forced_open{background:#fbd5d5}
.pill.running,.pill.compensating,.pill.pending,.pill.half_open{background:#fdf0c4}
.pill.completed,.pill.succeeded,.pill.closed,.pill.compensated{background:#d4f2dc}
.tiles{display:flex;gap:1rem;margin:.4rem 0}
.tiles div{padding:.3rem .8rem;border-radius:6px;background:#f0f2f5}
.tiles div.alert{background:#fbd5d5}
.tiles dt{font-size:.75rem;color:#555}.tiles dd{margin:0;font-size:1.3rem}
form.action{display:inline}
button{cursor:pointer;margin:0 .2rem .2rem 0}
.notice{padding:.5rem .9rem;border-radius:6px;margin:0 0 1rem;background:#d4f2dc}
.notice.error{background:#fbd5d5}
.empty{color:#666}
pre.payload{max-height:12rem;overflow:auto;background:#f5f6f8;padding:.4rem}
.login{max-width:24rem;margin:4rem auto}
.login input{width:100%;padding:.4rem;margin:.4rem 0;box-sizing:border-box}
svg.spark{vertical-align:middle;margin-right:.4rem;overflow:visible}
svg.spark path{fill:none;stroke:#3767c4;stroke-width:1.5;stroke-linecap:round;vector-effect:non-scaling-stroke}
.tiles dd svg.spark{display:block;margin-top:.2rem}
span.now{font-variant-numeric:tabular-nums}
p.span{font-size:.8rem;color:#555;margin:.2rem 0}
svg.timeline{vertical-align:middle}
rect.band.closed{fill:#d4f2dc}rect.band.half_open{fill:#f5d77a}rect.band.open{fill:#e0554f}rect.band.unknown{fill:#eceef2}
.charts{display:flex;flex-wrap:wrap;gap:1rem}
.charts figure{margin:0;max-width:100%}.charts svg{max-width:100%;height:auto;background:#f5f6f8}
figcaption{font-size:.8rem;color:#555}
"#;

const SCRIPT: &str = r#"
document.addEventListener('submit',function(e){const q=e.target.dataset.confirm;if(q&&!confirm(q))e.preventDefault();});
function keelAges(){const now=Date.now();document.querySelectorAll('[data-since]').forEach(function(el){
 const s=Math.max(0,Math.round((now-Date.parse(el.dataset.since))/1000));
 el.textContent=s<120?s+' s':s<7200?Math.round(s/60)+' min':Math.round(s/3600)+' h';});}
keelAges();setInterval(keelAges,1000);
(function(){const live=document.getElementById('live');let cap=1000;
 function connect(){const es=new EventSource(document.body.dataset.events||'/console/events');
 es.onopen=function(){cap=1000;live.dataset.live='true';live.textContent='live';};
 es.onerror=function(){live.dataset.live='false';live.textContent='reconnecting';
  if(es.readyState===EventSource.CLOSED){const wait=Math.random()*cap;cap=Math.min(cap*2,30000);setTimeout(connect,wait);}};
 es.addEventListener('sections',function(e){const data=JSON.parse(e.data);
  Object.keys(data).forEach(function(id){const el=document.getElementById(id);const s=data[id];
   if(el&&el.dataset.hash!==s.hash){el.innerHTML=s.html;el.dataset.hash=s.hash;}});
  document.body.dataset.updates=String(Number(document.body.dataset.updates||0)+1);keelAges();});}
 connect();})();
"#;

/// The console's `Content-Security-Policy`: nothing loads from anywhere,
/// and only the console's own inline script and style run (by hash), so
/// injected markup could neither run script nor send data away.
pub(crate) fn content_security_policy() -> &'static str {
    static CSP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        use base64::Engine as _;
        use sha2::Digest as _;
        let hash = |text: &str| {
            base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(text.as_bytes()))
        };
        format!(
            "default-src 'none'; script-src 'sha256-{}'; style-src 'sha256-{}'; \
             connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; \
             base-uri 'none'",
            hash(SCRIPT),
            hash(STYLE)
        )
    });
    &CSP
}

/// A section: its id, heading, content hash and HTML.
pub(crate) struct Section<'a> {
    pub(crate) id: &'a str,
    pub(crate) hash: &'a str,
    pub(crate) html: &'a str,
}

fn heading(id: &str) -> &'static str {
    match id {
        "summary" => "At a glance",
        "sagas" => "Sagas (running, compensating, stuck)",
        "dead-letters" => "Dead letters",
        "parked-outbox" => "Parked outbox rows (refused by the broker)",
        "webhook-deliveries" => "Webhook deliveries",
        "breakers" => "Circuit breakers",
        "lag" => "Outbox and consumer lag",
        "consumers" => "Consumer groups over time",
        "dependencies" => "Dependencies over time",
        "detail" => "What changed",
        _ => "",
    }
}

/// A console page: its sections and the live stream that updates them.
pub(crate) struct Page<'a> {
    pub(crate) title: &'a str,
    pub(crate) notice: Option<(&'a str, bool)>,
    pub(crate) sections: &'a [Section<'a>],
    pub(crate) logout: bool,
    /// The stream's URL (already encoded).
    pub(crate) events: &'a str,
}

/// A whole console page.
pub(crate) fn console(page: &Page<'_>) -> String {
    let Page {
        title,
        notice,
        sections,
        logout,
        events,
    } = *page;
    let mut body = String::new();
    if let Some((text, is_error)) = notice {
        let kind = if is_error { "error" } else { "ok" };
        body.push_str(&format!(
            "<div id=\"notice\" class=\"notice {kind}\" data-notice-kind=\"{kind}\">{}</div>",
            escape(text)
        ));
    }
    for s in sections {
        body.push_str(&format!(
            "<h2>{}</h2><section id=\"{id}\" data-hash=\"{hash}\">{html}</section>",
            heading(s.id),
            id = s.id,
            hash = s.hash,
            html = s.html,
        ));
    }
    let logout = if logout {
        "<form method=\"post\" action=\"/console/logout\"><button type=\"submit\" \
         data-action=\"logout\">Log out</button></form>"
    } else {
        ""
    };
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">\
         <title>{title}</title><style>{STYLE}</style></head><body data-events=\"{events}\">\
         <header><h1>{title}</h1><span id=\"live\" data-live=\"false\">connecting</span>{logout}</header>\
         <main>{body}</main><script>{SCRIPT}</script></body></html>",
        title = escape(title),
        events = escape(events),
    )
}

/// The login page, with an error if the last try failed.
pub(crate) fn login(title: &str, error: Option<&str>) -> String {
    let error = error
        .map(|e| {
            format!(
                "<p id=\"login-error\" class=\"notice error\">{}</p>",
                escape(e)
            )
        })
        .unwrap_or_default();
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{title} — log in</title><style>{STYLE}</style></head><body>\
         <div class=\"login\"><section><h2>{title}</h2>{error}\
         <form id=\"login\" method=\"post\" action=\"/console/login\">\
         <label for=\"token\">Admin token</label>\
         <input id=\"token\" name=\"token\" type=\"password\" autocomplete=\"current-password\" autofocus>\
         <button type=\"submit\" data-action=\"login\">Log in</button></form></section></div>\
         </body></html>",
        title = escape(title),
    )
}
